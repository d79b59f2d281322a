"""The all-reduce preflight gate (hybridflow.pipeline.preflight): runs that all-reduce nothing over the GPU
partition's fabric pass without reading a result (no SSH)."""

from __future__ import annotations

import pytest
from hybridflow.config import load_pipeline_config
from hybridflow.pipeline.preflight import check_latest_preflight


@pytest.mark.parametrize("nodes, ranks, side, fragment", [
    (1, 1, "gpu", "one rank: training all-reduces no gradients"),
    (1, 1, "cpu", "one rank: training all-reduces no gradients"),
    (1, 2, "cpu", "cpu placement: the ranks run as CPU processes on the CPU partition"),
    (2, 4, "cpu", "the GPU partition's all-reduce preflight does not apply"),
])
def test_preflight_passes_runs_without_a_gpu_all_reduce(nodes, ranks, side, fragment):
    assert fragment in check_latest_preflight(load_pipeline_config(), nodes, ranks, side)
