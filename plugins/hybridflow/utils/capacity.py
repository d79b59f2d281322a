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
    # Set when no set of the partition's nodes could ever run the request, whatever frees up: waiting is pointless.
    impossible: bool = False


def unsatisfiable_request(partition: str, nodes: Sequence[SinfoNode], gpus_per_node: int,
                          nodes_needed: int = 1) -> str | None:
    """Why no set of the partition's nodes could ever run ``nodes_needed`` x ``gpus_per_node``, whatever their state
    now; None when some set could (it may still have to wait).

    Judged on the nodes' configured GPUs, so a busy or drained node still counts: it can come back.
    """
    if not nodes:
        return f"partition {partition!r} has no nodes (does it exist? `sinfo -s` lists the partitions)"
    largest = max(nodes, key=lambda n: (n.gpus_total, n.name))
    big_enough = [n for n in nodes if n.gpus_total >= gpus_per_node]
    if len(big_enough) >= nodes_needed:
        return None
    request = f"{nodes_needed} node(s) x {gpus_per_node} GPU(s) can never run in partition {partition!r}"
    if not big_enough:
        return (f"{request}: its largest node is {largest.name} with {largest.gpus_total} GPU(s); ask for at most "
                f"{largest.gpus_total} GPU(s) per node, or use another partition")
    return (f"{request}: only {len(big_enough)} of its {len(nodes)} node(s) have {gpus_per_node}+ GPUs (largest: "
            f"{largest.name} with {largest.gpus_total}); ask for at most {len(big_enough)} node(s), or fewer GPUs per "
            "node")


def capacity_verdict(partition: str, nodes: Sequence[SinfoNode], pending: Sequence[SqueueRecord],
                     gpus_per_node: int, nodes_needed: int = 1, exclude: Sequence[str] = ()) -> CapacityVerdict:
    """Enough nodes that are up and each have ``gpus_per_node`` free GPUs; otherwise say why not. Nodes in
    ``exclude`` (one that failed its self-check) do not count."""
    nodes = [n for n in nodes if n.name not in exclude]
    total = sum(n.gpus_total for n in nodes)
    free = sum(n.gpus_free for n in nodes)
    fitting = [n for n in nodes if n.available and n.gpus_free >= gpus_per_node]
    impossible = unsatisfiable_request(partition, nodes, gpus_per_node, nodes_needed)
    if impossible:
        return CapacityVerdict(False, impossible, free, total, impossible=True)
    if len(fitting) >= nodes_needed:
        names = ", ".join(n.name for n in fitting[:nodes_needed])
        if gpus_per_node == 0:  # a CPU job: nodes up is what the gate can see; Slurm queues it for cores
            return CapacityVerdict(True, f"{partition}: {len(fitting)} node(s) up, no GPU asked; fits on {names}",
                                   free, total)
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
