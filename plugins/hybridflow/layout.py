"""Every path under the shared storage root, in one place: datasets, run directories, reports, models, alerts.

Paths are text joined with ``/``, the same text the Slurm jobs, Spark and asset URIs see (the root is mounted at
the same place on every host); wrap one in ``Path`` to open it here. Run directories are persisted (a rerun
reattaches to its directory by path), so a name here never changes: add a new one beside it instead.
A training run's directory (``TrainingRunDir``) is written by the operator and the job alike; the jobs read the
datasets and write the run's files through their own copy of these names (jobs/hybridjobs/layout.py), kept in
step by tests/unit/jobs/test_layout_contract.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_segment(text: str, *, trim: bool = True) -> str:
    """``text`` as one path segment: each run of characters outside ``[A-Za-z0-9._-]`` becomes ``_`` (run ids hold
    ``:`` and ``+``, and a manual one anything).

    Trimmed (the default), leading and trailing ``_`` and ``.`` go too, so the segment is never ``.``, ``..`` or
    hidden, and nothing left gives ``run``. Router run directories were named untrimmed (``trim=False``) and keep
    those names, since a rerun finds its directory by path.
    """
    segment = UNSAFE.sub("_", text)
    return (segment.strip("_.") or "run") if trim else segment


def asset_uri(path: str) -> str:
    """An Airflow asset's URI for a path under the root: an s3:// one as it is, a local one as ``file://``."""
    return path if "://" in path else f"file://{path}"


@dataclass(frozen=True)
class StorageLayout:
    """The storage root's layout; ``config.storage.layout`` gives the configured one."""

    root: str

    def _under(self, *parts: object) -> str:
        return "/".join((self.root, *map(str, parts)))

    # Datasets (raw, features, quarantine, predictions): one partition per ds, published with _SUCCESS.
    def dataset(self, name: str) -> str:
        return self._under(name)

    def partition(self, dataset: str, ds: str) -> str:
        return self._under(dataset, f"ds={ds}")

    # Runs: what the cluster jobs write.
    def run_logs(self, dag: str) -> str:
        """The Slurm logs of a DAG whose jobs share one folder (preflight, healthcheck, reliability_probe)."""
        return self._under("runs", dag, "logs")

    def training_run(self, ds: str, run_id: str) -> TrainingRunDir:
        """One nightly training run's directory (before its retrain generation, see ``for_generation``)."""
        return TrainingRunDir(self._under("runs", "nightly_training", f"ds={ds}", safe_segment(run_id)))

    def router_run_dir(self, run_id: str) -> str:
        """Where a router run's job writes its log and result: one directory per DAG run."""
        return self._under("runs", "router", safe_segment(run_id, trim=False))

    def preflight_result(self, nodes: int | str, ranks_per_node: int | str) -> str:
        """One result per topology, so measuring 2 nodes x 1 rank never replaces the 1 x 2 figures."""
        return self._under("runs", "preflight", f"{nodes}x{ranks_per_node}", "latest.json")

    # Reports: served by the UI plugin (hybridflow/ui.py) from below ``reports``.
    @property
    def reports(self) -> str:
        return self._under("reports")

    @staticmethod
    def report_path(dag_id: str, ds: str, run_id: str) -> str:
        """A run's report folder relative to ``reports``: the path its UI link carries."""
        return f"{dag_id}/ds={ds}/{safe_segment(run_id)}"

    def report_dir(self, dag_id: str, ds: str, run_id: str) -> str:
        return f"{self.reports}/{self.report_path(dag_id, ds, run_id)}"

    # Models: the files of each MLflow model version, as cluster jobs and Triton read them (pipeline/registry.py).
    def model_dir(self, name: str) -> str:
        return self._under("models", name)

    def model_version_dir(self, name: str, version: int, sha256: str = "") -> str:
        """``v<N>-<sha256[:12]>``: the MLflow version and its model's digest, so two MLflow servers (or the file
        registry before them) writing the same storage never name different models alike."""
        return self._under("models", name, f"v{version}-{sha256[:12]}" if sha256 else f"v{version}")

    def legacy_model_registry(self, name: str) -> str:
        """The earlier file registry, imported into MLflow once (``python -m hybridflow.pipeline.registry``)."""
        return self._under("models", name, "registry.json")

    # The GPU partition ledger (pipeline/utilization.py): one JSON row per partition and day.
    def utilization_day(self, partition: str, day: str) -> str:
        return self._under("utilization", safe_segment(partition), f"day={day}.json")

    @property
    def utilization_jobs(self) -> str:
        """Where each training job's time split waits for the ledger: ``<job id>.json``."""
        return self._under("utilization", "jobs")

    @property
    def alerts_file(self) -> str:
        """The local alert sink (notifiers/oncall.py) when HYBRIDFLOW_ALERTS_FILE does not name another."""
        return self._under("alerts", "alerts.jsonl")


# --- A training run's directory ---------------------------------------------------------------------------------
# The names the job writes (jobs/hybridjobs/layout.py spells the same ones) and the orchestrator's own beside them.
CONFIG_FILE = "config.json"  # the run config the operator writes and jobs/train.py reads
LOGS_DIR = "logs"  # the Slurm logs of the run's jobs (training, evaluation; a router run's too)
PROGRESS_FILE = "progress.json"
HEARTBEATS_DIR = "heartbeats"  # rank<r>.json per rank, for the stall watch
METRICS_FILE = "metrics.json"  # written once training finished
STEP_METRICS_FILE = "step_metrics.jsonl"  # rank 0's step figures, what MLflow gets
EVALUATION_FILE = "evaluation.json"  # the evaluation job's result (jobs/evaluate.py --out)
CHECKPOINTS_DIR = "checkpoints"  # step_<n>/ each
CHECKPOINT_MANIFEST = "MANIFEST.json"  # in each step_<n>/, written last
EXPORT_DIR = "export"
MODEL_FILE = "model.pt"
SIGNATURE_FILE = "signature.json"
SMOKE_FILE = "smoke.json"
EXPORT_FILES = (MODEL_FILE, SIGNATURE_FILE, SMOKE_FILE)  # what an export and a model version directory hold
MLFLOW_RUN_FILE = "mlflow_run.json"  # the run id, so every attempt continues the same MLflow run
CREDENTIALS_FILE = ".mlflow-credentials.json"  # 0600, removed once the task is done; the job finds it by name


@dataclass(frozen=True)
class TrainingRunDir:
    """One training run's directory and what is in it.

    ``root`` is text, possibly a template (``{{ ... }}``): each member only appends its name, so a member of a
    templated root renders to the member of the rendered root.
    """

    root: str

    def _member(self, name: str) -> str:
        return f"{self.root}/{name}"

    def for_generation(self, generation: int) -> TrainingRunDir:
        """Retrain generation ``generation``'s directory: this one for 0, else the sibling ``<root>.retrain-<N>``.

        A sibling, not a subdirectory: the new job starts from no checkpoint (fresh training, as after fixing data)
        and the earlier generation's checkpoints, export and metrics stay as they were. A root that already names
        generation N is returned unchanged, so the DAG's prepare step and the operator can both apply it.
        """
        if generation == 0:
            return self
        base, suffix = self.root.rstrip("/") or self.root, f".retrain-{generation}"
        return TrainingRunDir(base if base.endswith(suffix) else base + suffix)

    @property
    def config(self) -> str:
        return self._member(CONFIG_FILE)

    @property
    def logs(self) -> str:
        return self._member(LOGS_DIR)

    @property
    def progress(self) -> str:
        return self._member(PROGRESS_FILE)

    @property
    def heartbeats(self) -> str:
        return self._member(HEARTBEATS_DIR)

    @property
    def metrics(self) -> str:
        return self._member(METRICS_FILE)

    @property
    def step_metrics(self) -> str:
        return self._member(STEP_METRICS_FILE)

    @property
    def evaluation(self) -> str:
        return self._member(EVALUATION_FILE)

    @property
    def checkpoints(self) -> str:
        return self._member(CHECKPOINTS_DIR)

    @property
    def export(self) -> str:
        return self._member(EXPORT_DIR)

    def export_file(self, name: str) -> str:
        """One of ``EXPORT_FILES`` in the export."""
        return f"{self.export}/{name}"

    @property
    def model(self) -> str:
        return self.export_file(MODEL_FILE)

    @property
    def mlflow_run(self) -> str:
        return self._member(MLFLOW_RUN_FILE)

    @property
    def credentials(self) -> str:
        return self._member(CREDENTIALS_FILE)
