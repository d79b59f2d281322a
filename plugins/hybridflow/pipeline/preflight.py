"""The all-reduce preflight's result on the cluster, and whether it lets training start."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from hybridflow.config import PipelineConfig
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.pipeline.gates import preflight_verdict


def check_latest_preflight(config: PipelineConfig, nodes: int, ranks_per_node: int, side: str = "gpu") -> str:
    """Raise GateFailed unless the newest preflight of this topology is recent and under the share limit.

    A run of one rank all-reduces nothing: it passes with that said. So does a run placed on the CPU side: the
    preflight measures the GPU partition's all-reduce, which its ranks do not use.
    """
    if nodes * ranks_per_node == 1:
        return "one rank: training all-reduces no gradients, so there is no interconnect to gate"
    if side == "cpu":
        return ("cpu placement: the ranks run as CPU processes on the CPU partition; the GPU partition's all-reduce "
                "preflight does not apply")
    hook = SlurmHook(config.cluster.ssh_conn_id)
    try:
        text = hook.read_text(config.storage.layout.preflight_result(nodes, ranks_per_node))
    finally:
        hook.close()
    return preflight_verdict(
        json.loads(text) if text else None, datetime.now(UTC),
        max_share=config.preflight.max_allreduce_share, max_age=timedelta(days=config.preflight.max_age_days),
        topology=(nodes, ranks_per_node),
    )
