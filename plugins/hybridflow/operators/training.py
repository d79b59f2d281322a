"""DeepSpeed training as a Slurm job: the run config written to the cluster, the job followed, metrics back."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybridflow.config import NightlyConfig
from hybridflow.exceptions import GateFailed
from hybridflow.operators.slurm import SlurmSubmitOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

    from hybridflow.utils.slurm_jobs import SlurmJobKey, SlurmJobStatus



def summarise_metrics(metrics: Mapping[str, Any]) -> dict:
    """The figures of the job's metrics.json that the pipeline passes on (XCom stays small)."""
    holdout = metrics.get("holdout") or {}
    deepspeed, allreduce = metrics.get("deepspeed") or {}, metrics.get("allreduce") or {}
    return {
        "auc": holdout.get("auc"), "log_loss": holdout.get("log_loss"), "step": metrics.get("step"),
        "total_steps": metrics.get("total_steps"), "restarts": metrics.get("restarts"),
        "resumed_from_step": metrics.get("resumed_from_step"),
        "train_rows_processed": metrics.get("train_rows_processed"),
        "mean_gpu_utilization_pct": metrics.get("mean_gpu_utilization_pct"),
        "world_size": deepspeed.get("world_size"), "nodes": deepspeed.get("nodes"),
        "ranks": [f"{r.get('rank')}@{r.get('node')}" for r in deepspeed.get("ranks") or []],
        "zero_stage": deepspeed.get("zero_stage"),
        "allreduce_share_in_job": allreduce.get("share"),
        "gpus_sampled": (metrics.get("gpu") or {}).get("per_gpu"),
    }


class GenerationSlurmSubmitOperator(SlurmSubmitOperator):
    """
    A Slurm job of one training generation, e.g. evaluating its model: ``retrain`` (templated, 0 by default) puts
    the generation in the job name, so generation N follows its own job (never twice) and not an earlier
    generation's COMPLETED one. Generation 0 keeps the plain name.
    """

    template_fields: Sequence[str] = (*SlurmSubmitOperator.template_fields, "retrain")

    def __init__(self, *, retrain: int | str = 0, **kwargs):
        super().__init__(**kwargs)
        self.retrain = retrain

    def job_key(self, context: Context) -> SlurmJobKey:
        from dataclasses import replace

        from hybridflow.utils.slurm_jobs import generation

        return replace(super().job_key(context), retrain=generation(self.retrain))


class DeepSpeedTrainingOperator(GenerationSlurmSubmitOperator):
    """
    Trains with ``jobs/train.py`` on the GPU partition. Writes ``run_config`` (with ``run_dir`` filled in) to
    ``<run_dir>/config.json`` on the cluster, submits (or reattaches to) the job, logs its progress file while
    deferred, and returns the job's status with the holdout metrics and a GPU utilization report: GPU-hours from
    the allocation, mean utilization from the job's own samples. Below ``min_gpu_utilization_pct`` it warns, or
    fails when ``fail_on_low_utilization``. A retry resumes from the newest complete checkpoint in ``run_dir``;
    a new model on purpose (e.g. after fixing data) takes a new ``retrain`` generation.

    :param run_config: the training run config, a mapping or its JSON text (templated, so it can come from an
        upstream task's XCom); see jobs/hybridtrain/config.py.
    :param run_dir: the run's directory on the cluster's filesystem (templated).
    :param python: the cluster's job interpreter; ``jobs_dir`` where jobs/ is deployed there.
    :param retrain: the training generation (templated). 0: a cleared or rerun task follows the job its run already
        ran, even a COMPLETED one (never twice). N > 0: generation N's own job and run directory
        ``<run_dir>.retrain-<N>``, fresh (no checkpoint of an earlier generation), each at most once; the paths
        derived from ``run_dir`` (config, logs, progress) follow it.

    Data-parallel: ``nodes`` x ``gpus_per_node`` ranks, one per GPU, started by ``srun`` (``ranks_per_node``
    defaults to ``gpus_per_node``); the job reads its rank, world size and master address from Slurm.
    """

    template_fields: Sequence[str] = (*GenerationSlurmSubmitOperator.template_fields, "run_config", "run_dir")
    template_fields_renderers = {**SlurmSubmitOperator.template_fields_renderers, "run_config": "json"}

    def __init__(self, *, run_config: Mapping[str, Any] | str, run_dir: str, python: str, jobs_dir: str,
                 min_gpu_utilization_pct: float = NightlyConfig.min_gpu_utilization_pct,
                 fail_on_low_utilization: bool = NightlyConfig.fail_on_low_utilization, **kwargs):
        # paths derived from run_dir move with it to a generation's directory; ones given explicitly stay
        paths_from_run_dir = {key for key in ("log_dir", "progress_path") if key not in kwargs}
        kwargs.setdefault("log_dir", f"{run_dir}/logs")
        kwargs.setdefault("progress_path", f"{run_dir}/progress.json")
        kwargs.setdefault("ranks_per_node", kwargs.get("gpus_per_node", 1))
        super().__init__(command=[python, f"{jobs_dir}/train.py", "--config", f"{run_dir}/config.json"], **kwargs)
        self.run_config = run_config if isinstance(run_config, str) else dict(run_config)
        self.run_dir = run_dir
        self.min_gpu_utilization_pct = min_gpu_utilization_pct
        self.fail_on_low_utilization = fail_on_low_utilization
        self._paths_from_run_dir = paths_from_run_dir

    def render_template_fields(self, context: Context, jinja_env=None) -> None:
        super().render_template_fields(context, jinja_env)
        self._apply_generation()  # here, so the rendered fields shown in the UI are the paths the job uses

    def _apply_generation(self) -> None:
        """Moves the run to its generation's directory (idempotent): a retrain must not resume, from the earlier
        generation's checkpoints, a model that already finished."""
        from hybridflow.utils.slurm_jobs import generation, generation_run_dir

        run_dir = generation_run_dir(self.run_dir, generation(self.retrain))
        if run_dir == self.run_dir:
            return
        self.run_dir = run_dir
        self.command = [*self.command[:-1], f"{run_dir}/config.json"]
        if "log_dir" in self._paths_from_run_dir:
            self.log_dir = f"{run_dir}/logs"
        if "progress_path" in self._paths_from_run_dir:
            self.progress_path = f"{run_dir}/progress.json"

    def execute(self, context: Context) -> dict:
        self._apply_generation()  # again for callers that run execute() without rendering first
        run_config = json.loads(self.run_config) if isinstance(self.run_config, str) else self.run_config
        if not isinstance(run_config, dict):
            raise TypeError(f"run_config must be a JSON object, got {type(run_config).__name__}")
        self.hook.run(["mkdir", "-p", "--", self.run_dir])
        self.hook.write_text(f"{self.run_dir}/config.json",
                             json.dumps({**run_config, "run_dir": self.run_dir}, indent=2, sort_keys=True))
        return super().execute(context)

    def _finish(self, status: SlurmJobStatus, message: str = "") -> dict:
        from hybridflow.pipeline.gates import utilization_report
        from hybridflow.utils.slurm_jobs import generation

        result = super()._finish(status, message)  # raises unless the job COMPLETED
        metrics = json.loads(self.hook.read_text(f"{self.run_dir}/metrics.json") or "{}")
        allocated = status.alloc_tres.get("gres/gpu")
        gpus = int(allocated) if str(allocated or "").isdigit() else None
        report = utilization_report(gpus, status.elapsed_s, metrics.get("gpu"), self.min_gpu_utilization_pct)
        if report.verdict == "low" and self.fail_on_low_utilization:
            raise GateFailed(report.message)
        (self.log.warning if report.verdict != "ok" else self.log.info)("GPU utilization: %s", report.message)
        result.update(
            run_dir=self.run_dir,
            retrain=generation(self.retrain),
            metrics=summarise_metrics(metrics),
            utilization={"gpu_hours": report.gpu_hours, "mean_utilization_pct": report.mean_utilization_pct,
                         "verdict": report.verdict, "message": report.message},
        )
        return result
