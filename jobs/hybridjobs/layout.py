"""Where the datasets live under the storage root, for the jobs: ``<root>/<dataset>/ds=YYYY-MM-DD/``, and the names
of the files a training job writes in its run directory.

The jobs never import the Airflow plugin, so this is the jobs' copy of those parts of its layout
(plugins/hybridflow/layout.py); tests/unit/jobs/test_layout_contract.py keeps the two in step. Where run
directories, reports and models are is the plugin's: a job is handed those paths. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

DATASETS = ("raw", "features", "quarantine", "predictions")

# In a training run's directory (the plugin's TrainingRunDir): what the job writes there, and its export.
PROGRESS_FILE = "progress.json"
HEARTBEATS_DIR = "heartbeats"
METRICS_FILE = "metrics.json"
STEP_METRICS_FILE = "step_metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_MANIFEST = "MANIFEST.json"
EXPORT_DIR = "export"
MODEL_FILE = "model.pt"
SIGNATURE_FILE = "signature.json"
SMOKE_FILE = "smoke.json"


@dataclass(frozen=True)
class StorageLayout:
    """Paths as text joined with ``/``, the same text the plugin builds for the same root."""

    root: str

    def dataset(self, name: str) -> str:
        return f"{self.root}/{name}"

    def partition(self, dataset: str, ds: str) -> str:
        return f"{self.dataset(dataset)}/ds={ds}"
