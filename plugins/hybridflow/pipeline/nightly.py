"""Pure decisions of the nightly pipeline: what a run does (train? deploy?), which partitions it trains on, and
the figures its report shows. The DAG's tasks feed them what they read; nothing here touches I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import date, timedelta
from typing import Any

from hybridflow.config import DEPLOY_MODES
from hybridflow.utils.efficiency import describe_time_shares

MODES = ("auto", "always", "never")


class NightlyTask:
    """The nightly DAG's tasks whose results other tasks read (group.task), named once: the DAG's templates, its
    Python tasks and the run report pull XComs through these (tests/dags checks that each exists)."""

    PLAN = "preflight.plan"
    ALLREDUCE_PREFLIGHT = "preflight.allreduce_preflight"
    QUALITY_GATE = "quality.quality_gate"
    PREPARE = "training.prepare"
    TRAIN = "training.train"
    CHAMPION_CHALLENGER = "evaluation.champion_challenger"
    MODEL_OF_RECORD = "scoring.model_of_record"
    PLAN_DEPLOY = "deploy.plan_deploy"
    DEPLOY_MODEL = "deploy.deploy_model"
    FINISH_RELEASE = "deploy.finish_release"  # a release held for approval (deploy=ask), as the person decided


@dataclass(frozen=True)
class RunPlan:
    ds: str
    train: bool
    deploy_mode: str
    dry_run: bool
    reason: str
    # where training runs (hybridflow.pipeline.placement.TrainingPlacement.as_dict()); the capacity gate, the
    # train task and the report read it from the plan's XCom
    placement: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_run(run_type: str, params: Mapping[str, Any], ds: str,
             placement: Mapping[str, Any] | None = None) -> RunPlan:
    """``train=auto`` trains on scheduled and manual runs, not in a backfill (a backfill recomputes features and
    re-scores history with the model of record). ``deploy`` is decided after evaluation (see should_deploy).
    ``placement`` (CPU or GPU, hybridflow.pipeline.placement) is carried as decided."""
    train_mode, deploy_mode = params.get("train", "auto"), params.get("deploy", "auto")
    for name, mode, modes in (("train", train_mode, MODES), ("deploy", deploy_mode, DEPLOY_MODES)):
        if mode not in modes:
            raise ValueError(f"param {name}={mode!r}: choose one of {', '.join(modes)}")
    backfill = run_type == "backfill"
    train = train_mode == "always" or (train_mode == "auto" and not backfill)
    if train_mode == "auto":
        reason = ("backfill run: features and scores with the model of record, no training (set train=always "
                  "to retrain)") if backfill else f"{run_type} run: train a challenger"
    else:
        reason = f"train={train_mode} requested"
    if deploy_mode in ("auto", "ask") and backfill:
        reason += f"; a backfill never redeploys unless deploy=always (deploy={deploy_mode} given)"
        deploy_mode = "never"
    return RunPlan(ds=ds, train=train, deploy_mode=deploy_mode, dry_run=bool(params.get("dry_run", False)),
                   reason=reason, placement=dict(placement) if placement is not None else None)


def training_window(ds: str, window_days: int, published: Iterable[str]) -> list[str]:
    """The published feature partitions of the ``window_days`` days ending at ``ds`` (which must be one)."""
    end = date.fromisoformat(ds)
    start = (end - timedelta(days=window_days - 1)).isoformat()
    chosen = sorted(d for d in set(published) if start <= d <= ds)
    if ds not in chosen:
        raise ValueError(f"features/ds={ds} is not published: the features stage must run first")
    return chosen


def should_deploy(mode: str, promoted_version: int | None, champion_version: int | None,
                  serving_versions: Iterable[int]) -> tuple[bool, str]:
    """``auto`` (and ``ask``, which then asks a person before the promotion) deploys a model promoted by this
    run, or the champion when the server does not serve it."""
    serving = sorted(set(serving_versions))
    if champion_version is None:
        return False, "no model of record to deploy"
    if mode == "never":
        return False, "deploy=never"
    if mode == "always":
        return True, f"deploy=always: deploying champion v{champion_version}"
    if promoted_version is not None:
        return True, f"v{promoted_version} was promoted by this run"
    if not serving:
        return True, f"the server serves no version; deploying champion v{champion_version}"
    return False, f"the champion v{champion_version} is unchanged (the server has {serving})"


def zero_stage_for(forced: int | None, nodes: int, one_node: int, several_nodes: int) -> tuple[int, str]:
    """The ZeRO stage of a training run and why. Precision (bf16 autocast on GPUs with bf16, float32 elsewhere),
    the optimizer (AdamW, torch's fused kernel on CUDA) and clipping (on the device, before each optimizer step)
    the job picks from its device (jobs/hybridtrain/config.py); the stage depends on the topology: the ranks of one
    node all-reduce over its own links, where ZeRO's partitioning only adds collectives and host syncs; across
    nodes, sharding the optimizer state costs no more traffic than an all-reduce."""
    if forced is not None:
        return forced, f"ZeRO stage {forced}: nightly.zero_stage forces it"
    if nodes <= 1:
        return one_node, f"ZeRO stage {one_node}: one node (nightly.zero_stage_one_node)"
    return several_nodes, f"ZeRO stage {several_nodes}: {nodes} nodes (nightly.zero_stage_several_nodes)"


def strategy_text(deepspeed: Mapping[str, Any]) -> str | None:
    """What the job chose, from its metrics.json ``deepspeed``: ``ZeRO 0, bf16 (autocast over float32 weights) on
    cuda, fused AdamW, clipping by loop``."""
    if not deepspeed or deepspeed.get("zero_stage") is None:
        return None
    precision = deepspeed.get("precision") or deepspeed.get("requested_precision") or "?"
    dtype = f" ({deepspeed['dtype']} weights)" if deepspeed.get("dtype") else ""
    optimizer = "fused AdamW" if deepspeed.get("fused_optimizer") else "AdamW"
    clipping = f", clipping by {deepspeed['gradient_clipping_by']}" if deepspeed.get("gradient_clipping_by") else ""
    return (f"ZeRO {deepspeed['zero_stage']}, {precision}{dtype} on {deepspeed.get('device') or '?'}, "
            f"{optimizer}{clipping}")


def features_figures(manifest: Mapping[str, Any] | None, executor_cores: int) -> dict[str, Any] | None:
    if not manifest:
        return None
    quarantine, source = manifest.get("quarantine") or {}, manifest.get("input") or {}
    return {
        "raw_rows": source.get("raw_rows"),
        "feature_rows": manifest.get("row_count"),
        "quarantined_rows": quarantine.get("rows"),
        "quarantine_ratio": quarantine.get("ratio"),
        "customers": manifest.get("row_count"),
        "wall_s": (manifest.get("job") or {}).get("seconds"),
        "executor_cores": executor_cores,
    }


def scoring_figures(manifest: Mapping[str, Any] | None, executor_cores: int) -> dict[str, Any] | None:
    if not manifest:
        return None
    job = manifest.get("job") or {}
    return {
        "rows": manifest.get("row_count"),
        "wall_s": job.get("seconds"),
        "rows_per_s": job.get("rows_per_s"),
        "model_version": (manifest.get("model") or {}).get("version"),
        "executor_cores": executor_cores,
    }


def training_figures(result: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None,
                     preflight: str | None = None) -> dict[str, Any] | None:
    """From the training task's return value, the job's metrics.json and the preflight gate's summary (None when
    the run did not train). A job on the CPU side (its result's ``placement_side``) holds no GPU: 0 GPUs, and its
    CPU-hours (AllocTRES cpu x Elapsed) are what it cost."""
    if not result:
        return None
    summary, utilization, metrics = result.get("metrics") or {}, result.get("utilization") or {}, metrics or {}
    tres = result.get("alloc_tres") or {}
    side = result.get("placement_side") or "gpu"
    gpus = tres.get("gres/gpu", "0" if side == "cpu" else None)
    cpus, elapsed = _whole_number(tres.get("cpu")), result.get("elapsed_s")
    return {
        "job_id": result.get("job_id"),
        "state": result.get("state"),
        "elapsed_s": elapsed,
        "placement_side": side,
        "partition": result.get("partition"),
        "gpus": _whole_number(gpus),
        "cpus": cpus,
        "cpu_hours": cpus * elapsed / 3600 if cpus is not None and isinstance(elapsed, int | float) else None,
        "utilization_verdict": utilization.get("message"),
        "ranks": summary.get("world_size"),
        "nodes": summary.get("nodes"),
        "rank_placement": ", ".join(summary.get("ranks") or []) or None,
        "zero_stage": summary.get("zero_stage"),
        "strategy": strategy_text(metrics.get("deepspeed") or {}),
        "allreduce_share_in_job": summary.get("allreduce_share_in_job"),
        "allreduce_preflight": preflight,
        "gpu_utilization_per_gpu": per_gpu_text(summary.get("gpus_sampled")),
        "gpu_hours": utilization.get("gpu_hours"),
        "mean_gpu_utilization_pct": utilization.get("mean_utilization_pct"),
        "restarts": summary.get("restarts"),
        "efficiency": result.get("efficiency"),  # from Slurm's accounting (utils/efficiency.py)
        "time_split": describe_time_shares(result.get("time_split")),
        "healing": healing_text(result.get("recovery")),
        "train_rows_processed": summary.get("train_rows_processed"),
        "auc": summary.get("auc"),
        "log_loss": summary.get("log_loss"),
        "step": summary.get("step"),
        "loss_curve": loss_points(metrics.get("loss_curve")),
    }


def healing_text(records: Any) -> str | None:
    """What was done to heal the training job (its recovery log, hybridflow.utils.failures), one clause each:
    ``stall of rank 1@gpu-node-02 -> requeued; node gpu-node-01 failed its self-check (scratch) -> excluded``;
    ``none`` when nothing was needed, None when the task predates the recovery log."""
    if records is None:
        return None
    clauses = []
    for record in records:
        kind = record.get("kind")
        if kind == "stall":
            ranks = ", ".join(f"rank {r.get('rank')}@{r.get('node') or '?'}"
                              for r in (record.get("stall") or {}).get("ranks", []))
            clauses.append(f"stall of {ranks or 'unknown ranks'} -> requeued")
        elif kind == "requeue":
            clauses.append(f"{record.get('class', 'failure')} -> requeued")
        elif kind == "exclude_node":
            clauses.append(f"node {record.get('node')} failed its self-check ({record.get('check')}) -> excluded")
    return "; ".join(clauses) or "none"


def _whole_number(value: Any) -> int | None:
    return int(value) if str(value if value is not None else "").isdigit() else None


def placement_figures(training: Mapping[str, Any] | None,
                      evaluation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The run report's placement figures: the plan's training decision (TrainingPlacement.as_dict()) and the
    prepare task's evaluation decision (EvaluationPlacement.as_dict()); None when the run did not train."""
    if not training:
        return None
    evaluation = evaluation or {}
    figures = {key: training.get(key) for key in ("device", "side", "partition", "gpus_per_node", "ranks_per_node",
                                                  "rule", "reason", "gpu_speedup", "min_gpu_speedup")}
    for side in ("cpu", "gpu"):
        measured = training.get(side) or {}
        figures[side] = {key: measured.get(key) for key in ("rows_per_s", "usd_per_1k_rows", "measured")}
    figures["evaluation"] = {key: evaluation.get(key) for key in ("side", "partition", "gpus_per_node", "reason",
                                                                 "cpu_s", "max_cpu_s")} if evaluation else None
    return figures


def loss_points(curve: Any) -> list[list[float]] | None:
    """metrics.json's loss curve ({"step", "loss"} records) as [step, loss] pairs."""
    if not curve:
        return None
    return [[point["step"], point["loss"]] if isinstance(point, Mapping) else list(point) for point in curve]


def per_gpu_text(per_gpu: Any) -> str | None:
    """``"gpu-node-01:0 87%, gpu-node-02:0 85%"`` from the job's per-GPU utilization summary (None: not sampled)."""
    if not per_gpu:
        return None
    parts = []
    for gpu in per_gpu:
        mean = gpu.get("mean_utilization_pct")
        parts.append(f"{gpu.get('host')}:{gpu.get('index')} " + ("n/a" if mean is None else f"{mean:.0f}%"))
    return ", ".join(parts)
