"""``<run_dir>/metrics.json``: the finished run's account, written once by rank 0 after the export. No torch here:
the caller passes in what only the engine knows."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from hybridtrain.allreduce import summarise_allreduce
from hybridtrain.checkpoints import MANIFEST_NAME, step_dir_name
from hybridtrain.config import RunConfig
from hybridtrain.features import HOLDOUT_RULE
from hybridtrain.gpu import read_run_gpu_metrics, summarise_gpu_metrics
from hybridtrain.loop_window import LoopWindow
from hybridtrain.plan import TrainingPlan
from hybridtrain.state import TrainingState
from hybridtrain.tracking import code_version

__all__ = ["TOKEN_DEFINITION", "model_details", "run_metrics"]

TOKEN_DEFINITION = "one training row (a customer-day of features) = one token"


def model_details(config: RunConfig, n_parameters: int) -> dict[str, Any]:
    """The network as ``metrics.json`` and the export's signature describe it."""
    return {
        "preset": config.model.preset,
        "hidden_sizes": list(config.model.hidden_sizes),
        "dropout": config.model.dropout,
        "n_parameters": n_parameters,
    }


def run_metrics(
    *,
    config: RunConfig,
    plan: TrainingPlan,
    data: Any,
    state: TrainingState,
    restarts: int,
    wall_time_s: float,
    time_split_s: dict[str, float],
    loop: LoopWindow,
    n_parameters: int,
    n_trainable: int,
    engine: Mapping[str, Any],
    torch_version: str,
    exported: dict[str, Any],
) -> dict[str, Any]:
    """The contents of ``metrics.json``; ``state.evaluation`` must be of the final step.

    :param data: the run's ``runner.PreparedData``.
    :param wall_time_s: since the process started.
    :param time_split_s: rank 0's wall seconds per phase (``time_split``): start-up, data, checkpoints,
        evaluation and export apart from the steps.
    :param loop: this attempt's timed steps (``loop_window``), whose rows/s is the headline ``samples_per_s``.
    :param n_trainable: trainable parameters, the gradient volume an all-reduce sample moves.
    :param engine: what only the engine knows, under ``deepspeed``: ``version``, ``nodes``, ``ranks``,
        ``device``, ``dtype``, ``precision``, ``gradient_clipping_by`` and ``fused_optimizer``.
    """
    evaluation = state.evaluation
    rows_processed = state.step * plan.rows_per_step
    train_wall_s = state.train_wall_s()
    gpu_records = read_run_gpu_metrics(config.run_dir)
    gpu = summarise_gpu_metrics(gpu_records)
    loop_figures = loop.figures(plan.rows_per_step, gpu_records)
    return {
        "status": "completed",
        "run_id": config.run_id,
        "labels": config.labels,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "step": state.step,
        "total_steps": plan.total_steps,
        "steps_per_epoch": plan.steps_per_epoch,
        "epochs_completed": plan.epochs_completed(state.step),
        "restarts": restarts,
        "resumed_from_step": state.resumed_from,
        "holdout": {
            "auc": evaluation["auc"],
            "log_loss": evaluation["log_loss"],
            "rows": evaluation["rows"],
            "positives": evaluation["positives"],
            "fraction": config.holdout_fraction,
            "rule": HOLDOUT_RULE,
        },
        "train": {
            "rows": len(data.train_y),
            "positives": int(data.train_y.sum()),
            "final_loss": state.last_loss,
        },
        "loss_curve": [{"step": step, "loss": loss} for step, loss in state.loss_curve],
        "train_rows_processed": rows_processed,
        "train_tokens_processed": rows_processed,
        "token_definition": TOKEN_DEFINITION,
        "train_wall_time_s": train_wall_s,
        "wall_time_s": wall_time_s,
        "time_split_s": time_split_s,
        "samples_per_s": loop_figures["rows_per_s"],
        "loop": loop_figures,
        "gpu": gpu,
        "mean_gpu_utilization_pct": gpu["mean_utilization_pct"],  # the whole job's, as the partition ledger bills it
        "model": model_details(config, n_parameters),
        "deepspeed": {
            **engine,
            "zero_stage": config.zero_stage,
            "world_size": plan.world_size,
            "collective_timeout_s": config.collective_timeout_s,
            "config": str(config.deepspeed_config),
            "requested_precision": config.precision,
        },
        "allreduce": summarise_allreduce(
            state.allreduce_samples,
            every_steps=config.allreduce_sample_every_steps,
            world_size=plan.world_size,
            elements=n_trainable,
        ),
        "code_version": code_version(),
        "torch_version": torch_version,
        "python_version": platform.python_version(),
        "hyperparameters": {
            "batch_size": config.batch_size,
            "micro_batch": plan.batch_size,
            "accumulation": plan.accumulation,
            "global_batch": plan.rows_per_step,
            "learning_rate": config.learning_rate,
            "epochs": config.epochs,
            "max_steps": config.max_steps,
            "seed": config.seed,
        },
        "data": {
            "features_root": config.features_root,
            "ds": list(config.ds),
            "rows_per_partition": data.rows_per_partition,
            "feature_columns": list(data.feature_columns),
            "sha256": data.fingerprint,
        },
        "checkpoint": {
            "step": state.last_checkpoint,
            "path": str(config.checkpoints_dir / step_dir_name(state.last_checkpoint)),
            "manifest": MANIFEST_NAME,
        },
        "export": exported,
    }
