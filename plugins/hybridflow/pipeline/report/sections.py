"""The report's sections: the whitelist of figures each stage may show, and which of them a stage reports as None
on purpose. Only what is listed here is read from a stage's figures, so nothing else it pushed (hosts, paths,
tokens) can reach the report.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.layout import METRICS_FILE


@dataclass(frozen=True)
class Field:
    """One whitelisted figure: its name in the report, its place in the stage's figures, how to read it."""

    name: str
    path: tuple[str, ...]
    label: str
    kind: str  # "count", "number", "text", "flag" or "link"
    unit: str | None = None


def _fields(*rows: tuple) -> tuple[Field, ...]:
    return tuple(Field(name, tuple(path.split(".")), label, kind, unit)
                 for name, path, label, kind, unit in rows)


SECTIONS: dict[str, tuple[str, tuple[Field, ...]]] = {
    "features": ("Features (Spark)", _fields(
        ("raw_rows", "raw_rows", "Raw rows read", "count", "rows"),
        ("feature_rows", "feature_rows", "Feature rows written", "count", "rows"),
        ("quarantined_rows", "quarantined_rows", "Rows quarantined", "count", "rows"),
        ("quarantine_ratio", "quarantine_ratio", "Quarantine ratio", "number", "ratio"),
        ("customers", "customers", "Customers", "count", "customers"),
        ("wall_s", "wall_s", "Wall time", "number", "s"),
        ("executor_cores", "executor_cores", "Executor cores", "count", "cores"),
    )),
    "quality": ("Data quality gate", _fields(
        ("passed", "passed", "Gate passed", "flag", None),
    )),
    "placement": ("Placement (CPU or GPU, from measured figures)", _fields(
        ("device", "device", "Requested device", "text", None),
        ("side", "side", "Training side", "text", None),
        ("partition", "partition", "Training partition", "text", None),
        ("gpus_per_node", "gpus_per_node", "GPUs per node", "count", "GPUs"),
        ("ranks_per_node", "ranks_per_node", "Ranks per node", "count", "ranks"),
        ("rule", "rule", "Rule applied", "text", None),
        ("reason", "reason", "Decision", "text", None),
        ("cpu_rows_per_s", "cpu.rows_per_s", "CPU training throughput per rank", "number", "rows/s"),
        ("cpu_usd_per_1k_rows", "cpu.usd_per_1k_rows", "CPU cost per 1,000 rows", "number", "USD"),
        ("cpu_measured", "cpu.measured", "CPU figure measured", "text", None),
        ("gpu_rows_per_s", "gpu.rows_per_s", "GPU training throughput per rank", "number", "rows/s"),
        ("gpu_usd_per_1k_rows", "gpu.usd_per_1k_rows", "GPU cost per 1,000 rows", "number", "USD"),
        ("gpu_measured", "gpu.measured", "GPU figure measured", "text", None),
        ("gpu_speedup", "gpu_speedup", "GPU speedup per rank", "number", "x"),
        ("min_gpu_speedup", "min_gpu_speedup", "GPU wins at a speedup of at least", "number", "x"),
        ("evaluation_partition", "evaluation.partition", "Evaluation partition", "text", None),
        ("evaluation_gpus", "evaluation.gpus_per_node", "Evaluation GPUs", "count", "GPUs"),
        ("evaluation_cpu_s", "evaluation.cpu_s", "Evaluation estimated on CPU", "number", "s"),
        ("evaluation_reason", "evaluation.reason", "Evaluation decision", "text", None),
    )),
    "training": ("Training (DeepSpeed on Slurm)", _fields(
        ("job_id", "job_id", "Slurm job id", "text", None),
        ("state", "state", "Final state", "text", None),
        ("elapsed_s", "elapsed_s", "Elapsed", "number", "s"),
        ("placement_side", "placement_side", "Side", "text", None),
        ("partition", "partition", "Partition", "text", None),
        ("gpus", "gpus", "GPUs allocated", "count", "GPUs"),
        ("cpus", "cpus", "CPUs allocated", "count", "CPUs"),
        ("cpu_hours", "cpu_hours", "CPU-hours", "number", "CPU-h"),
        ("ranks", "ranks", "Ranks (one per GPU)", "count", "ranks"),
        ("nodes", "nodes", "Nodes", "count", "nodes"),
        ("rank_placement", "rank_placement", "Rank placement (rank@node)", "text", None),
        ("zero_stage", "zero_stage", "ZeRO stage", "count", None),
        ("strategy", "strategy", "Training strategy (what the job chose)", "text", None),
        ("allreduce_share_in_job", "allreduce_share_in_job", "All-reduce share of a step, measured in the job",
         "number", "ratio"),
        ("allreduce_preflight", "allreduce_preflight", "All-reduce preflight (same topology)", "text", None),
        ("gpu_hours", "gpu_hours", "GPU-hours", "number", "GPU-h"),
        ("mean_gpu_utilization_pct", "mean_gpu_utilization_pct", "Mean GPU utilization", "number", "%"),
        ("gpu_utilization_per_gpu", "gpu_utilization_per_gpu", "Utilization per GPU (the job's own)", "text", None),
        ("utilization_verdict", "utilization_verdict", "GPU utilization verdict", "text", None),
        ("restarts", "restarts", "Restarts (requeues)", "count", None),
        ("queue_wait_s", "efficiency.queue_wait_s", "Queue wait (submit to start)", "number", "s"),
        ("time_limit_share", "efficiency.time_limit_share", "Share of the time limit used", "number", "ratio"),
        ("cpu_efficiency", "efficiency.cpu_efficiency", "CPU efficiency (TotalCPU / CPUs x elapsed)", "number",
         "ratio"),
        ("max_rss_gib", "efficiency.max_rss_gib", "Max RSS of a step", "number", "GiB"),
        ("requested_mem_gib", "efficiency.requested_mem_gib", "Memory requested", "number", "GiB"),
        ("gpu_hours_allocated", "efficiency.gpu_hours_allocated", "GPU-hours allocated (Slurm accounting)",
         "number", "GPU-h"),
        ("lost_to_requeues_s", "efficiency.lost_to_requeues_s", "Time lost to requeues", "number", "s"),
        ("time_split", "time_split", "Where the job's time went (shares of its allocated time)", "text", None),
        ("healing", "healing", "Healing (stalls, failure classes, excluded nodes)", "text", None),
        ("train_rows_processed", "train_rows_processed", "Training rows processed", "count", "rows"),
        ("step", "step", "Last step", "count", None),
        ("auc", "auc", "Holdout AUC", "number", None),
        ("log_loss", "log_loss", "Holdout log loss", "number", None),
    )),
    "evaluation": ("Evaluation (challenger vs champion)", _fields(
        ("challenger_auc", "challenger.auc", "Challenger AUC", "number", None),
        ("challenger_log_loss", "challenger.log_loss", "Challenger log loss", "number", None),
        ("champion_version", "champion.version", "Champion version", "text", None),
        ("champion_auc", "champion.auc", "Champion AUC", "number", None),
        ("champion_log_loss", "champion.log_loss", "Champion log loss", "number", None),
        ("decision", "decision", "Decision", "text", None),
        ("margin", "margin", "Required margin", "number", None),
        ("reason", "reason", "Reason", "text", None),
    )),
    "record": ("MLflow (the system of record)", _fields(
        ("run_id", "run_id", "Training run", "text", None),
        ("run_url", "run_url", "Training run page", "link", None),
        ("experiment", "experiment", "Experiment", "text", None),
        ("model_version", "model_version", "Registered model version", "text", None),
        ("model_uri", "model_uri", "Model URI", "text", None),
        ("promoted", "promoted", "Became the champion", "flag", None),
    )),
    "scoring": ("Batch scoring (Spark)", _fields(
        ("rows", "rows", "Rows scored", "count", "rows"),
        ("wall_s", "wall_s", "Wall time", "number", "s"),
        ("rows_per_s", "rows_per_s", "Throughput", "number", "rows/s"),
        ("model_version", "model_version", "Model version", "text", None),
        ("executor_cores", "executor_cores", "Executor cores", "count", "cores"),
    )),
    "deploy": ("Deploy (Triton)", _fields(
        ("model", "model", "Model", "text", None),
        ("version", "version", "Version deployed", "text", None),
        ("previous_version", "previous_version", "Previous version", "text", None),
        ("promoted", "promoted", "Promoted", "flag", None),
        ("load_s", "load_s", "Load time", "number", "s"),
        ("smoke_rows", "smoke.rows", "Smoke test rows", "count", "rows"),
        ("smoke_max_abs_error", "smoke.max_abs_error", "Smoke max abs error", "number", None),
        ("smoke_atol", "smoke.atol", "Smoke tolerance", "number", None),
        ("latency_requests", "latency.requests", "Latency test requests", "count", None),
        ("latency_concurrency", "latency.concurrency", "Concurrency", "count", None),
        ("latency_p50_ms", "latency.p50_ms", "Latency p50", "number", "ms"),
        ("latency_p99_ms", "latency.p99_ms", "Latency p99", "number", "ms"),
        ("latency_throughput_rps", "latency.throughput_rps", "Throughput", "number", "req/s"),
        ("latency_failed", "latency.failed", "Failed requests", "count", None),
        ("latency_decision", "latency.decision", "Latency gate decision", "text", None),
        ("release_decision", "release.decision", "Last release step decision", "text", None),
    )),
}

# Figures a stage reports as None on purpose, and what that means.
NOT_MEASURED_WHEN_NONE: dict[str, dict[tuple[str, ...], str]] = {
    "placement": {
        **{(side, key): f"no {side.upper()} figure for the preset in pipeline.yaml placement.training"
           for side in ("cpu", "gpu") for key in ("rows_per_s", "usd_per_1k_rows")},
        ("gpu_speedup",): "a side's throughput is not measured",
        **{("evaluation", key): "the evaluation was not planned (no prepare result)"
           for key in ("partition", "gpus_per_node", "reason")},
        ("evaluation", "cpu_s"): "the CPU scoring rate or the holdout size is not measured (or no evaluation "
                                 "was planned)",
    },
    "training": {("mean_gpu_utilization_pct",): "no GPU sampled", ("gpu_utilization_per_gpu",): "no GPU sampled",
                 ("allreduce_share_in_job",): "one rank all-reduces no gradients",
                 ("time_split",): f"the job wrote no time split (time_split_s in {METRICS_FILE})"},
    "evaluation": {("champion", key): "no champion (first model)" for key in ("auc", "log_loss", "version")},
    "deploy": {("previous_version",): "no previous version (first deploy)",
               ("release", "decision"): "no release steps (first deploy, the version already served, or "
                                        "serving.release.strategy: direct)"},
    "record": {("model_version",): "no model was registered (the evaluation did not run)",
               ("model_uri",): "no model was registered (the evaluation did not run)",
               ("promoted",): "no model was registered (the evaluation did not run)"},
}

CHECK_KEYS = ("name", "column", "observed", "expected", "passed")
