"""Pure verdicts of the gates around training: the all-reduce preflight and GPU utilization after a run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from hybridflow.exceptions import GateFailed

PREFLIGHT_RUNBOOK = "include/runbooks/preflight.md"
UTILIZATION_RUNBOOK = "include/runbooks/training.md"


def preflight_verdict(result: Mapping | None, now: datetime, max_share: float = 0.20,
                      max_age: timedelta = timedelta(days=8)) -> str:
    """
    Training may start only after a recent preflight in which all-reducing the gradients took at most
    ``max_share`` of a step. Returns a one-line summary, or raises :class:`GateFailed` naming the figures.
    """
    if not result:
        raise GateFailed(f"no all-reduce preflight result found; run the cluster_preflight DAG. Runbook: "
                         f"{PREFLIGHT_RUNBOOK}")
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
    gpu_hours: float
    mean_utilization_pct: float | None
    verdict: str  # "ok", "low", "not_measured"
    message: str


def utilization_report(alloc_gpus: int, elapsed_s: float, gpu_summary: Mapping | None,
                       min_utilization_pct: float = 40.0) -> UtilizationReport:
    """GPU-hours from the allocation (AllocTRES x Elapsed) and the mean utilization the job sampled."""
    gpu_hours = alloc_gpus * elapsed_s / 3600
    mean = (gpu_summary or {}).get("mean_utilization_pct")
    if mean is None:
        reason = (gpu_summary or {}).get("reason", "no GPU metrics")
        return UtilizationReport(gpu_hours, None, "not_measured",
                                 f"{gpu_hours:.3f} GPU-hours allocated; utilization not measured ({reason})")
    if mean < min_utilization_pct:
        return UtilizationReport(gpu_hours, mean, "low", (
            f"{gpu_hours:.3f} GPU-hours at {mean:.0f}% mean utilization, under the {min_utilization_pct:.0f}% "
            f"floor: the job paid for GPUs it did not use. Runbook: {UTILIZATION_RUNBOOK}"))
    return UtilizationReport(gpu_hours, mean, "ok", f"{gpu_hours:.3f} GPU-hours at {mean:.0f}% mean utilization")
