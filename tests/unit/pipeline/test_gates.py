"""Preflight and utilization gates, by tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hybridflow.exceptions import GateFailed
from hybridflow.pipeline.gates import preflight_verdict, utilization_report

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def result(share_ms: float, compute_ms: float = 80.0, age: timedelta = timedelta(hours=1)) -> dict:
    return {"measured_at": (NOW - age).isoformat(), "allreduce_s": share_ms / 1e3, "compute_step_s": compute_ms / 1e3,
            "allreduce_share": share_ms / (share_ms + compute_ms), "busbw_gbps_at_largest": 180.5, "world_size": 16,
            "backend": "nccl", "topology": {"nodes": 2, "ranks_per_node": 8}}


def test_preflight_passes_a_fresh_fast_result():
    summary = preflight_verdict(result(10), NOW)
    assert "11.1% of a step" in summary and "180.50 GB/s over 16 ranks (nccl)" in summary


@pytest.mark.parametrize(
    "res, fragment",
    [
        (None, "no all-reduce preflight result"),
        (result(30), "the network is the bottleneck: all-reduce 30.0 ms vs compute 80.0 ms per step = 27.3%"),
        (result(10, age=timedelta(days=9)), "stale (9 days old, limit 8)"),
    ],
    ids=["missing", "slow-network", "stale"],
)
def test_preflight_refuses(res, fragment):
    with pytest.raises(GateFailed, match="Runbook: include/runbooks/preflight.md") as err:
        preflight_verdict(res, NOW)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "measured, wanted, fragment",
    [
        ({"nodes": 1, "ranks_per_node": 2}, (2, 1), "the preflight measured 1 node(s) x 2 rank(s), not the 2 node(s) "
                                                    "x 1 rank(s) this run trains on: run cluster_preflight with "
                                                    "nodes=2, gpus_per_node=1"),
        ({"nodes": 2, "ranks_per_node": 1}, (1, 2), "not the 1 node(s) x 2 rank(s)"),
        ({"nodes": 2, "ranks_per_node": 8}, (2, 4), "not the 2 node(s) x 4 rank(s)"),
        (None, (2, 8), "the preflight measured an unrecorded topology"),
    ],
    ids=["ranks-vs-nodes", "nodes-vs-ranks", "fewer-ranks", "old-result-without-topology"],
)
def test_preflight_of_another_topology_does_not_clear_a_run(measured, wanted, fragment):
    res = result(10) | {"topology": measured}
    with pytest.raises(GateFailed, match="Runbook: include/runbooks/preflight.md") as err:
        preflight_verdict(res, NOW, topology=wanted)
    assert fragment in str(err.value)


def test_preflight_of_the_same_topology_clears_a_run():
    assert "11.1% of a step" in preflight_verdict(result(10), NOW, topology=(2, 8))


def test_missing_preflight_names_the_topology_wanted():
    with pytest.raises(GateFailed, match=r"no all-reduce preflight result found for 2 node\(s\) x 1 rank\(s\)"):
        preflight_verdict(None, NOW, topology=(2, 1))


def test_preflight_threshold_is_configurable():
    assert preflight_verdict(result(30), NOW, max_share=0.30)


@pytest.mark.parametrize(
    "gpus, elapsed, summary, verdict, hours, fragment",
    [
        (8, 1800, {"mean_utilization_pct": 87.0}, "ok", 4.0, "87% mean"),
        (8, 3600, {"mean_utilization_pct": 15.0}, "low", 8.0, "under the 40% floor"),
        (1, 360, {"gpu_available": False, "reason": "nvidia-smi not found", "mean_utilization_pct": None},
         "not_measured", 0.1, "not measured (nvidia-smi not found)"),
        (2, 60, None, "not_measured", 2 * 60 / 3600, "no GPU metrics"),
    ],
)
def test_utilization_report(gpus, elapsed, summary, verdict, hours, fragment):
    report = utilization_report(gpus, elapsed, summary)
    assert report.verdict == verdict
    assert report.gpu_hours == pytest.approx(hours)
    assert fragment in report.message


@pytest.mark.parametrize(
    "gpus, elapsed, fragment",
    [(None, 600, "GPU-hours not measured (Slurm reported no allocated GPUs)"),
     (2, None, "GPU-hours not measured (Slurm reported no elapsed time)")],
)
def test_gpu_hours_are_not_measured_when_the_allocation_or_elapsed_time_is_unknown(gpus, elapsed, fragment):
    report = utilization_report(gpus, elapsed, {"mean_utilization_pct": 90.0})
    assert report.gpu_hours is None
    assert fragment in report.message and "0.000" not in report.message


@pytest.mark.parametrize("gpus, summary", [
    (None, None), (0, None),
    (None, {"gpu_available": True, "mean_utilization_pct": 3.0}),  # a node's GPUs the job may see: not its own
])
def test_utilization_of_a_cpu_placement_is_not_judged(gpus, summary):
    report = utilization_report(gpus, 600, summary, side="cpu")
    assert (report.verdict, report.gpu_hours, report.mean_utilization_pct) == ("no_gpu", 0.0, None)
    assert report.message.startswith("no GPU allocated (cpu placement)")
