"""Where the datasets live under the storage root, for the jobs: ``<root>/<dataset>/ds=YYYY-MM-DD/``.

The jobs never import the Airflow plugin, so this is the jobs' copy of the dataset part of its layout
(plugins/hybridflow/layout.py); tests/unit/jobs/test_layout_contract.py keeps the two in step. Run directories,
reports and models are the plugin's: a job is handed those paths. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

DATASETS = ("raw", "features", "quarantine", "predictions")


@dataclass(frozen=True)
class StorageLayout:
    """Paths as text joined with ``/``, the same text the plugin builds for the same root."""

    root: str

    def dataset(self, name: str) -> str:
        return f"{self.root}/{name}"

    def partition(self, dataset: str, ds: str) -> str:
        return f"{self.dataset(dataset)}/ds={ds}"
