"""Pure verdicts of the gates around training: the all-reduce preflight and GPU utilization after a run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from hybridflow.config import NightlyConfig, PreflightConfig
from hybridflow.exceptions import GateFailed

PREFLIGHT_RUNBOOK = "include/runbooks/preflight.md"
UTILIZATION_RUNBOOK = "include/runbooks/training.md"


def topology_text(nodes: int, ranks_per_node: int) -> str:
    return f"{nodes} node(s) x {ranks_per_node} rank(s)"


def preflight_verdict(result: Mapping | None, now: datetime,
                      max_share: float = PreflightConfig.max_allreduce_share,
                      max_age: timedelta = timedelta(days=PreflightConfig.max_age_days),
                      topology: tuple[int, int] | None = None) -> str:
    """
    Training may start only after a recent preflight of the same topology in which all-reducing the gradients
    took at most ``max_share`` of a step. Returns a one-line summary, or raises :class:`GateFailed` naming the
    figures.

    :param topology: ``(nodes, ranks_per_node)`` of the training run the preflight must have measured; None
        accepts any (the preflight DAG judging its own result).
    """
    wanted = "" if topology is None else f" for {topology_text(*topology)}"
    if not result:
        raise GateFailed(f"no all-reduce preflight result found{wanted}; run the cluster_preflight DAG with "
                         f"these nodes and GPUs per node. Runbook: {PREFLIGHT_RUNBOOK}")
    measured = result.get("topology") or {}
    if topology is not None and (measured.get("nodes"), measured.get("ranks_per_node")) != tuple(topology):
        seen = (topology_text(measured["nodes"], measured["ranks_per_node"]) if measured
                else "an unrecorded topology")
        raise GateFailed(f"the preflight measured {seen}, not the {topology_text(*topology)} this run trains on: "
                         f"run cluster_preflight with nodes={topology[0]}, gpus_per_node={topology[1]}. "
                         f"Runbook: {PREFLIGHT_RUNBOOK}")
    measured_at = datetime.fromisoformat(result["measured_at"])
    age = now - measured_at
    share, busbw = float(result["allreduce_share"]), float(result["busbw_gbps_at_largest"])
    figures = (f"all-reduce {result['allreduce_s'] * 1e3:.1f} ms vs compute {result['compute_step_s'] * 1e3:.1f} ms "
               f"per step = {share:.1%} of a step; bus bandwidth {busbw:.2f} GB/s over {result['world_size']} ranks "
               f"({result['backend']}), measured {measured_at.isoformat()}")
    if age > max_age:
        raise GateFailed(f"the last preflight is stale ({age.days} days old, limit {max_age.days}): {figures}. "
                         f"Run the cluster_preflight DAG. Runbook: {PREFLIGHT_RUNBOOK}")
    if share > max_share:
        raise GateFailed(f"the network is the bottleneck: {figures}, over the {max_share:.0%} limit. Check the "
                         f"interconnect (NCCL_DEBUG=INFO, IB links) before training. Runbook: {PREFLIGHT_RUNBOOK}")
    return figures


@dataclass(frozen=True)
class UtilizationReport:
    gpu_hours: float | None
    mean_utilization_pct: float | None
    verdict: str  # "ok", "low", "not_measured", "no_gpu"
    message: str


NO_GPU_MESSAGE = "no GPU allocated (cpu placement)"


def utilization_report(alloc_gpus: int | None, elapsed_s: float | None, gpu_summary: Mapping | None,
                       min_utilization_pct: float = NightlyConfig.min_gpu_utilization_pct,
                       side: str = "gpu") -> UtilizationReport:
    """GPU-hours from the allocation (AllocTRES x Elapsed) and the mean utilization the job sampled.

    GPU-hours are None ("not measured", with the reason) when the allocation or the elapsed time is unknown:
    never a 0 that reads as measured. A job placed on the CPU side (``side="cpu"``) asked for no GPU: 0 GPU-hours,
    and its utilization is not judged (a node's GPUs it may see belong to other jobs).
    """
    if side == "cpu" and not alloc_gpus:
        return UtilizationReport(0.0, None, "no_gpu", f"{NO_GPU_MESSAGE}: GPU utilization not judged")
    if alloc_gpus is None or elapsed_s is None:
        unknown = "allocated GPUs" if alloc_gpus is None else "elapsed time"
        gpu_hours, hours_text = None, f"GPU-hours not measured (Slurm reported no {unknown})"
    else:
        gpu_hours = alloc_gpus * elapsed_s / 3600
        hours_text = f"{gpu_hours:.3f} GPU-hours"
    mean = (gpu_summary or {}).get("mean_utilization_pct")
    if mean is None:
        reason = (gpu_summary or {}).get("reason", "no GPU metrics")
        return UtilizationReport(gpu_hours, None, "not_measured",
                                 f"{hours_text} allocated; utilization not measured ({reason})")
    if mean < min_utilization_pct:
        return UtilizationReport(gpu_hours, mean, "low", (
            f"{hours_text} at {mean:.0f}% mean utilization, under the {min_utilization_pct:.0f}% "
            f"floor: the job paid for GPUs it did not use. Runbook: {UTILIZATION_RUNBOOK}"))
    return UtilizationReport(gpu_hours, mean, "ok", f"{hours_text} at {mean:.0f}% mean utilization")
