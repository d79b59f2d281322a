"""The unit tests' run report input: one night's figures from every stage, with every figure measured, and the
prices its costs are hand-computed with (tests/unit/pipeline/test_report*.py)."""

from __future__ import annotations

import copy

from hybridflow.config import CostConfig

from helpers.nested import change_at

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PRICES = CostConfig(gpu_hour_usd=2.5, cpu_hour_usd=0.05, serving_hour_usd=1.2)

FIGURES = {
    "dag_id": "nightly_training",
    "run_id": "scheduled__2026-01-05T00:00:00+00:00",
    "ds": "2026-01-05",
    "generated_at": "2026-01-06T01:00:00+00:00",
    "features": {"raw_rows": 1_000_000, "feature_rows": 50_000, "quarantined_rows": 2_000,
                 "quarantine_ratio": 0.002, "customers": 50_000, "wall_s": 1800.0, "executor_cores": 4},
    "quality": {"passed": True, "checks": [
        {"name": "row_count.min", "column": None, "observed": 50_000, "expected": ">= 100", "passed": True}]},
    "placement": {"device": "auto", "side": "gpu", "partition": "gpu-training", "gpus_per_node": 4,
                  "ranks_per_node": 4, "rule": "gpu-speedup", "reason": "large: GPU 50x faster -> gpu-training",
                  "cpu": {"rows_per_s": 9800.0, "usd_per_1k_rows": 2.8e-6, "measured": "2-core machine, 2026-12"},
                  "gpu": {"rows_per_s": 490000.0, "usd_per_1k_rows": 1.4e-6, "measured": "one H200, 2026-12"},
                  "gpu_speedup": 50.0, "min_gpu_speedup": 10.0,
                  "evaluation": {"side": "cpu", "partition": "cpu", "gpus_per_node": 0, "cpu_s": 0.1,
                                 "max_cpu_s": 30.0, "reason": "evaluation: ~0.1 s on CPU -> cpu partition"}},
    "training": {"job_id": "4711", "state": "COMPLETED", "elapsed_s": 3600.0, "gpus": 8, "gpu_hours": 8.0,
                 "placement_side": "gpu", "partition": "gpu-training", "cpus": 16, "cpu_hours": 16.0,
                 "utilization_verdict": "8.000 GPU-hours at 84% mean utilization",
                 "mean_gpu_utilization_pct": 83.5, "restarts": 1, "healing": "preempted -> requeued",
                 "train_rows_processed": 4_000_000,
                 "auc": 0.81, "log_loss": 0.41, "step": 1000, "ranks": 8, "nodes": 2, "zero_stage": 2,
                 "strategy": "ZeRO 2, bf16 (float32 weights) on cuda, fused AdamW, clipping by loop",
                 "rank_placement": "0@gpu-node-01, 1@gpu-node-01, 2@gpu-node-02", "allreduce_share_in_job": 0.12,
                 "allreduce_preflight": "all-reduce 9.0 ms vs compute 80.0 ms per step = 10.1% of a step",
                 "gpu_utilization_per_gpu": "gpu-node-01:0 84%, gpu-node-02:0 83%",
                 "efficiency": {"queue_wait_s": 4.0, "time_limit_share": 0.5, "cpu_efficiency": 0.62,
                                "max_rss_gib": 11.5, "requested_mem_gib": 64.0, "gpu_hours_allocated": 8.0,
                                "lost_to_requeues_s": 120, "not_measured": {}},
                 "time_split": "training steps 61%, data loading 9%, checkpoint writes 6%, waiting 20%",
                 "loss_curve": [[0, 0.69], [500, 0.5], [1000, 0.45]]},
    "evaluation": {"challenger": {"auc": 0.81, "log_loss": 0.41},
                   "champion": {"auc": 0.79, "log_loss": 0.43, "version": "6"},
                   "decision": "promote", "margin": 0.005, "reason": "challenger AUC 0.81 > 0.79 + 0.005"},
    "record": {"run_id": "ab" * 16, "run_url": f"http://127.0.0.1:5000/#/experiments/9/runs/{'ab' * 16}",
               "experiment": "nightly_training", "model_version": 7, "model_uri": "models:/propensity/7",
               "promoted": True, "history": [{"ds": f"2026-01-0{day}", "auc": 0.8 + day / 100, "rows": 1e6,
                                               "train_s": 60.0 + day} for day in range(1, 6)]},
    "scoring": {"rows": 2_000_000, "wall_s": 360.0, "rows_per_s": 5555.6, "model_version": "7",
                "executor_cores": 10},
    "deploy": {"model": "propensity", "version": "7", "previous_version": "6", "promoted": True,
               "load_s": 2.1,
               "smoke": {"rows": 16, "max_abs_error": 1e-7, "atol": 1e-5},
               "latency": {"requests": 1000, "concurrency": 8, "p50_ms": 4.2, "p99_ms": 12.5,
                           "throughput_rps": 500.0, "failed": 0,
                           "decision": "pass: p99 12.50 ms of 980 requests after 20 warm-up; 95% bounds [11.90, "
                                       "13.40] ms; SLO p99 50 ms, failed only on a lower bound over it"},
               "release": {"strategy": "progressive", "steps": [], "no_traffic": False,
                           "decision": "canary 50% pass: pass: errors 0 of 412 <= 8, the most a 1.00% rate "
                                       "explains at 95%; pass: p50 ratio >= 0.91 <= 1.5 (95%: candidate p50 >= 4.1 "
                                       "ms of 412, stable p50 <= 4.5 ms of 420)"}},
}

# The nights from MLflow with a gap: a night without a figure, a figure not finite, a night without a valid ds
NIGHTS_WITH_GAPS = [{"ds": "2026-01-01", "auc": 0.8, "rows": 1e6, "train_s": 60.0},
                    {"ds": "2026-01-02", "auc": None, "rows": float("nan"), "train_s": 61.0}, {"ds": 3}]


def figures_with(**changes) -> dict:
    """FIGURES with dotted paths replaced; a value of ``...`` deletes the key."""
    figures = copy.deepcopy(FIGURES)
    for dotted, value in changes.items():
        change_at(figures, dotted.split("__"), value, delete_marker=...)
    return figures


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE), path
