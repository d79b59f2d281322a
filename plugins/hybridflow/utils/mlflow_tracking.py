"""What a training task records in MLflow, as pure functions of the run config, the job's files and the task's
identity (the hook does the I/O; layout.TrainingRunDir names the files). ``step_metrics.jsonl`` is written by
jobs/hybridtrain/tracking.py; a test writes it with the job's writer and reads it with ``read_step_metrics`` here."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RUN_KEY_TAG = "hybridflow.run_key_sha"
RETRAIN_OF_TAG = "hybridflow.retrain_of"
JOB_NAME_TAG = "hybridflow.slurm_job_name"
JOB_NAME_SHA_TAG = "hybridflow.slurm_job_name_sha"  # searchable without escaping: on-call finds a job's run by it
ONCALL_TAG = "hybridflow.oncall_action"
_RUN_ID = re.compile(r"[0-9a-f]{32}")
# MLflow's limits: experiment names and tag values are stored verbatim, but not beyond these lengths
MAX_EXPERIMENT_NAME = 500
MAX_TAG_VALUE = 5000
_MAX_PARAM_VALUE = 6000


@dataclass(frozen=True)
class TrainingRunIdentity:
    """One MLflow run per training task and generation: a retry, a cleared task or a requeued job finds it."""

    dag_id: str
    task_id: str
    run_id: str
    generation: int

    @property
    def key(self) -> str:
        return json.dumps([self.dag_id, self.task_id, self.run_id, self.generation])

    @property
    def key_sha(self) -> str:
        """The tag value a search finds the run by: hex, so no name a user chose reaches the filter's syntax."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:32]

    def first_generation(self) -> TrainingRunIdentity:
        return TrainingRunIdentity(self.dag_id, self.task_id, self.run_id, 0)

    @property
    def run_name(self) -> str:
        suffix = f"-retrain-{self.generation}" if self.generation else ""
        return f"{self.task_id}-{self.run_id}{suffix}"[:250]


def validate_experiment_name(name: Any, where: str) -> str:
    """An experiment name is stored verbatim; only empty, over-long or control characters are refused."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_EXPERIMENT_NAME:
        raise ValueError(f"{where}: {name!r}; use a non-empty name of at most {MAX_EXPERIMENT_NAME} characters")
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        raise ValueError(f"{where}: {name!r} holds control characters; use printable text")
    return name


def stored_run_id(text: str | None) -> str | None:
    """The run id in a run directory's ``mlflow_run.json``, or None when absent or unreadable."""
    try:
        run_id = json.loads(text or "").get("run_id")
    except (ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id) else None


def clip(value: Any, limit: int = MAX_TAG_VALUE) -> str:
    """A value as MLflow stores it: text verbatim (JSON for anything else), cut to its limit."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def job_name_sha(job_name: str) -> str:
    return hashlib.sha256(job_name.encode()).hexdigest()[:32]


def job_name_tags(job_name: str) -> dict[str, str]:
    """The run's Slurm job name (deterministic, known before submission), and its digest for searches."""
    return {JOB_NAME_TAG: clip(job_name), JOB_NAME_SHA_TAG: job_name_sha(job_name)}


def oncall_tag(action: Mapping[str, Any], at: str, requested_by: str) -> dict[str, str]:
    """What an on-call action did to a training run's job, and why, as one tag on the run."""
    before, after = action.get("before") or {}, action.get("after") or {}
    return {ONCALL_TAG: clip(f"{at}: {action.get('action')} of Slurm job {action.get('job_id')} by {requested_by}: "
                             f"{before.get('state')} -> {after.get('state')}; reason: {action.get('reason')}")}


def start_tags(identity: TrainingRunIdentity, *, try_number: int | None, ds: str | None) -> dict[str, str]:
    tags = {
        RUN_KEY_TAG: identity.key_sha,
        "hybridflow.dag_id": identity.dag_id,
        "hybridflow.task_id": identity.task_id,
        "hybridflow.airflow_run_id": identity.run_id,
        "hybridflow.retrain_generation": str(identity.generation),
        "hybridflow.try_number": "" if try_number is None else str(try_number),
        "mlflow.runName": identity.run_name,
        "mlflow.source.name": "jobs/train.py",
    }
    if ds:
        tags["hybridflow.ds"] = ds
    return {key: clip(value, MAX_TAG_VALUE) for key, value in tags.items()}


def training_params(run_config: Mapping[str, Any], *, nodes: int, gpus_per_node: int,
                    ranks_per_node: int) -> dict[str, str]:
    """The run's params: fixed before the job starts (MLflow params are write-once), so every attempt logs the
    same values."""
    model = run_config.get("model")
    preset = model.get("preset") if isinstance(model, Mapping) else None
    ds = run_config.get("ds")
    days = [ds] if isinstance(ds, str) else list(ds or [])
    window = run_config.get("ds_range") or ({"start": min(days), "end": max(days)} if days else None)
    params = {
        "model_preset": preset if preset is not None else model,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "ranks_per_node": ranks_per_node,
        "world_size": nodes * ranks_per_node,
        "zero_stage": run_config.get("zero_stage"),
        "batch_size": run_config.get("batch_size"),
        "gradient_accumulation_steps": run_config.get("gradient_accumulation_steps", 1),
        "learning_rate": run_config.get("learning_rate"),
        "epochs": run_config.get("epochs"),
        "max_steps": run_config.get("max_steps"),
        "precision": run_config.get("precision", "auto"),
        "seed": run_config.get("seed"),
        "data_window": window,
        "data_days": len(days),
    }
    return {key: clip(value, _MAX_PARAM_VALUE) for key, value in params.items() if value is not None}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


# The job's efficiency from Slurm's accounting (utils/efficiency.py) -> its MLflow metric
EFFICIENCY_METRICS = {"queue_wait_s": "slurm_queue_wait_s", "time_limit_share": "slurm_time_limit_share",
                      "cpu_efficiency": "slurm_cpu_efficiency", "max_rss_gib": "slurm_max_rss_gib",
                      "gpu_hours_allocated": "slurm_gpu_hours_allocated",
                      "lost_to_requeues_s": "slurm_lost_to_requeues_s"}


def final_metrics(metrics: Mapping[str, Any], *, gpu_hours: float | None = None,
                  efficiency: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The job's summary figures from ``metrics.json`` and Slurm's accounting (those that exist: a figure not
    measured is absent)."""
    holdout = metrics.get("holdout") or {}
    allreduce = metrics.get("allreduce") or {}
    figures = {
        "final_holdout_auc": holdout.get("auc"),
        "final_holdout_log_loss": holdout.get("log_loss"),
        "train_rows_per_s": metrics.get("samples_per_s"),
        "train_wall_time_s": metrics.get("train_wall_time_s"),
        "train_rows_processed": metrics.get("train_rows_processed"),
        "restarts": metrics.get("restarts"),
        "allreduce_share": allreduce.get("share"),
        "mean_gpu_utilization_pct": metrics.get("mean_gpu_utilization_pct"),
        "gpu_hours": gpu_hours,
        **{metric: (efficiency or {}).get(figure) for figure, metric in EFFICIENCY_METRICS.items()},
    }
    return {key: number for key, value in figures.items() if (number := _number(value)) is not None}


def finish_tags(metrics: Mapping[str, Any], *, slurm_job_id: str, partition: str) -> dict[str, str]:
    deepspeed = metrics.get("deepspeed") or {}
    data = metrics.get("data") or {}
    ranks = deepspeed.get("ranks")
    nodes = sorted({str(rank.get("node")) for rank in ranks if isinstance(rank, Mapping)}) if isinstance(ranks, list) \
        else None
    tags = {
        "hybridflow.slurm_job_id": slurm_job_id,
        "hybridflow.partition": partition,
        "hybridflow.nodes": ",".join(nodes) if nodes else None,
        "hybridflow.code_version": metrics.get("code_version"),
        "hybridflow.features_sha256": data.get("sha256"),
        "hybridflow.precision": deepspeed.get("precision"),
        "hybridflow.device": deepspeed.get("device"),
    }
    return {key: clip(value, MAX_TAG_VALUE) for key, value in tags.items() if value not in (None, "")}


def read_step_metrics(text: str) -> list[dict[str, Any]]:
    """MLflow metric records from a ``step_metrics.jsonl`` text: the last line wins for a step written twice (a
    resumed job repeats the steps after its checkpoint); unreadable lines (cut by a crash) are skipped."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
            step, timestamp_ms = int(row.pop("step")), int(row.pop("timestamp_ms"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        for key, value in row.items():
            if (number := _number(value)) is not None:
                latest[(key, step)] = {"key": key, "value": number, "timestamp": timestamp_ms, "step": step}
    return sorted(latest.values(), key=lambda r: (r["step"], r["key"]))


def records_to_log(records: list[dict[str, Any]], logged: Mapping[str, set[int]]) -> list[dict[str, Any]]:
    """The records whose (metric, step) the run does not hold yet: a step is never logged twice, and a step the
    job wrote but could not send before it was killed is not lost behind later live points."""
    return [r for r in records if r["step"] not in logged.get(r["key"], ())]


HISTORY_NIGHTS = 30


def nightly_history(runs: list[Mapping[str, Any]], nights: int = HISTORY_NIGHTS) -> list[dict[str, Any]]:
    """The last ``nights`` data days of finished training runs (MLflow ``runs/search`` results): per ds the run
    that ended last, with its holdout AUC, rows trained and training time (None where the run lacks one)."""
    latest: dict[str, tuple[int, dict[str, Any]]] = {}
    for run in runs:
        info, data = run.get("info") or {}, run.get("data") or {}
        tags = {t.get("key"): t.get("value") for t in data.get("tags") or []}
        metrics = {m.get("key"): m.get("value") for m in data.get("metrics") or []}
        ds = tags.get("hybridflow.ds")
        if info.get("status") != "FINISHED" or not isinstance(ds, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", ds):
            continue
        ended = int(info.get("end_time") or 0)
        night = {"ds": ds, "auc": _number(metrics.get("final_holdout_auc")),
                 "rows": _number(metrics.get("train_rows_processed")),
                 "train_s": _number(metrics.get("train_wall_time_s")), "run_id": info.get("run_id")}
        if ds not in latest or ended > latest[ds][0]:
            latest[ds] = (ended, night)
    return [latest[ds][1] for ds in sorted(latest)[-nights:]]
