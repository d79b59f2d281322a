"""Every path under the shared storage root, in one place: datasets, run directories, reports, models, alerts.

Paths are text joined with ``/``, the same text the Slurm jobs, Spark and asset URIs see (the root is mounted at
the same place on every host); wrap one in ``Path`` to open it here. Run directories are persisted (a rerun
reattaches to its directory by path), so a name here never changes: add a new one beside it instead.
The jobs read the datasets through their own copy (jobs/hybridjobs/layout.py), kept in step by
tests/unit/jobs/test_layout_contract.py.
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

    def training_run_dir(self, ds: str, run_id: str) -> str:
        """One nightly training run (before its retrain generation, see utils/slurm_jobs.generation_run_dir)."""
        return self._under("runs", "nightly_training", f"ds={ds}", safe_segment(run_id))

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
