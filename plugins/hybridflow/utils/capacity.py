"""Can the GPU partition run a job now? A pure verdict from sinfo and squeue answers, with the reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.utils.slurm import SINFO_GPU_FORMAT, SQUEUE_FORMAT, SinfoNode, SqueueRecord


def capacity_sinfo_argv(partition: str) -> list[str]:
    return ["sinfo", "--noheader", "--Node", f"--partition={partition}", f"--Format={SINFO_GPU_FORMAT}"]


def capacity_squeue_argv(partition: str) -> list[str]:
    return ["squeue", "--noheader", "--states=PENDING", f"--partition={partition}", "-o", SQUEUE_FORMAT]


@dataclass(frozen=True)
class CapacityVerdict:
    can_run_now: bool
    reason: str
    gpus_free: int
    gpus_total: int


def capacity_verdict(partition: str, nodes: Sequence[SinfoNode], pending: Sequence[SqueueRecord],
                     gpus_per_node: int, nodes_needed: int = 1) -> CapacityVerdict:
    """Enough nodes that are up and each have ``gpus_per_node`` free GPUs; otherwise say why not."""
    total = sum(n.gpus_total for n in nodes)
    free = sum(n.gpus_free for n in nodes)
    fitting = [n for n in nodes if n.available and n.gpus_free >= gpus_per_node]
    if not nodes:
        return CapacityVerdict(False, f"partition {partition!r} has no nodes (does it exist?)", 0, 0)
    if len(fitting) >= nodes_needed:
        names = ", ".join(n.name for n in fitting[:nodes_needed])
        return CapacityVerdict(True, f"{partition}: {free}/{total} GPUs free; fits on {names}", free, total)
    states = ", ".join(f"{n.name} {n.state}{''.join(sorted(n.flags))} {n.gpus_free}/{n.gpus_total} free"
                       for n in nodes)
    reasons = Counter(r.reason for r in pending)
    queue = ", ".join(f"{count} pending ({reason})" for reason, count in reasons.most_common()) or "no jobs pending"
    return CapacityVerdict(
        False,
        f"{partition}: need {nodes_needed} node(s) with {gpus_per_node} free GPU(s); have {len(fitting)} "
        f"[{states}]; queue: {queue}",
        free, total,
    )
