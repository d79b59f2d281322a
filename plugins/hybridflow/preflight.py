"""The all-reduce preflight's result on the cluster, and whether it lets training start."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from hybridflow.config import PipelineConfig
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.utils.gates import preflight_verdict


def preflight_result_path(config: PipelineConfig) -> str:
    return f"{config.storage.root}/runs/preflight/latest.json"


def check_latest_preflight(config: PipelineConfig) -> str:
    """Raise GateFailed unless the newest preflight is recent and under the all-reduce share limit."""
    hook = SlurmHook(config.cluster.ssh_conn_id)
    try:
        text = hook.read_text(preflight_result_path(config))
    finally:
        hook.close()
    return preflight_verdict(
        json.loads(text) if text else None, datetime.now(UTC),
        max_share=config.preflight.max_allreduce_share, max_age=timedelta(days=config.preflight.max_age_days),
    )
