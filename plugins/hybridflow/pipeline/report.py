"""The run report: what each stage of a pipeline run measured, what it cost, and what could not be measured.

:func:`build_report` turns the figures gathered from the stages' XComs into the report's JSON,
:func:`render_html` and :func:`render_charts` draw it, and :func:`write_report` publishes ``report.json``,
``report.html`` and the PNG charts together, replacing an earlier report of the same run.

Nothing in the report is invented. Only the whitelisted figures of :data:`SECTIONS` are read, so nothing
else a stage pushed (hosts, paths, tokens) can reach the report. A measured figure is
``{"value": v, "unit": u}``; a figure that is absent, None, not finite or of the wrong type is
``{"value": null, "why": "not measured: ..."}``, and so is every derived figure (a cost) whose input is
missing, naming the input. A section may be None (the stage was skipped: a backfill does not train or
deploy). Every figure not measured is also listed in the report's ``not_measured``. Standard library only,
except matplotlib, imported when charts are drawn.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.atomic import staged_dir
from hybridflow.config import CostConfig, ServingConfig
from hybridflow.layout import METRICS_FILE

REPORT_FORMAT_VERSION = 1
DEFAULT_P99_SLO_MS = ServingConfig.slo_p99_ms
MAX_TEXT_CHARS = 200
MAX_CHECKS = 200
JSON_NAME = "report.json"
HTML_NAME = "report.html"
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Field:
    """One whitelisted figure: its name in the report, its place in the stage's figures, how to read it."""

    name: str
    path: tuple[str, ...]
    label: str
    kind: str  # "count", "number", "text" or "flag"
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
    "deploy": {("previous_version",): "no previous version (first deploy)"},
    "record": {("model_version",): "no model was registered (the evaluation did not run)",
               ("model_uri",): "no model was registered (the evaluation did not run)",
               ("promoted",): "no model was registered (the evaluation did not run)"},
}

DS_PATTERN = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# A link the report renders as <a href>: http(s), a host, then only characters that need no escaping in a URL
SAFE_LINK = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/#-]*)?")

CHECK_KEYS = ("name", "column", "observed", "expected", "passed")

COST_LABELS = {
    "training_run_usd": "Training run (GPU-hours; CPU-hours on the CPU placement)",
    "per_million_training_rows_usd": "Per million training rows",
    "features_cpu_hours": "Features CPU-hours",
    "features_usd": "Features (CPU)",
    "scoring_cpu_hours": "Scoring CPU-hours",
    "scoring_usd": "Batch scoring (CPU)",
    "per_1000_batch_predictions_usd": "Per 1,000 batch predictions",
    "per_1000_realtime_inferences_usd": "Per 1,000 realtime inferences",
}


@dataclass(frozen=True)
class Chart:
    name: str
    file: str
    title: str


CHARTS = (
    Chart("loss_curve", "loss_curve.png", "Training loss"),
    Chart("holdout_metrics", "holdout_metrics.png", "Holdout metrics: challenger vs champion"),
    Chart("deploy_latency", "deploy_latency.png", "Realtime latency vs SLO"),
    Chart("nightly_history", "nightly_history.png", "Last 30 nights (MLflow)"),
)


def measured(value: Any, unit: str | None = None, basis: str | None = None) -> dict:
    figure = {"value": value}
    if unit:
        figure["unit"] = unit
    if basis:
        figure["basis"] = basis
    return figure


def not_measured(why: str) -> dict:
    return {"value": None, "why": f"{NOT_MEASURED}: {why}"}


def _truncate(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_measured(figure: Mapping | None) -> bool:
    return bool(figure) and figure.get("value") is not None


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return value


def read_figure(raw: Any, kind: str) -> tuple[Any, str | None]:
    """``(value, None)`` for a valid figure of ``kind``, else ``(None, why it is not measured)``. The value
    itself is never quoted in the reason: it failed validation, so it is not a figure the report may show."""
    if raw is None:
        return None, "missing"
    if kind == "flag":
        if isinstance(raw, bool):
            return raw, None
        return None, f"not a true/false value ({type(raw).__name__})"
    if kind == "link":
        if isinstance(raw, str) and SAFE_LINK.fullmatch(raw):
            return raw, None
        return None, "not an http(s) address"
    if kind == "text":
        if isinstance(raw, str | int) and not isinstance(raw, bool):
            return _truncate(str(raw)), None
        return None, f"not a text value ({type(raw).__name__})"
    number = _number(raw)
    if number is None:
        return None, ("not a finite number" if isinstance(raw, float)
                      else f"not a number ({type(raw).__name__})")
    if kind == "count":
        if number < 0 or number != int(number):
            return None, "not a non-negative whole number"
        return int(number), None
    return number, None


def _lookup(section: Mapping, path: tuple[str, ...]) -> Any:
    node: Any = section
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def build_section(name: str, figures: Any) -> dict:
    """One stage's whitelisted figures, each measured or saying why not."""
    if figures is None:
        return {"ran": False, "why": f"{NOT_MEASURED}: the {name} stage did not run in this run",
                "figures": {}}
    if not isinstance(figures, Mapping):
        return {"ran": False, "why": f"{NOT_MEASURED}: the {name} stage's figures are not a mapping",
                "figures": {}}
    out: dict[str, dict] = {}
    for field in SECTIONS[name][1]:
        value, why = read_figure(_lookup(figures, field.path), field.kind)
        if why is None:
            out[field.name] = measured(value, field.unit)
        elif field.path in NOT_MEASURED_WHEN_NONE.get(name, {}) and _is_explicit_none(figures, field.path):
            out[field.name] = not_measured(NOT_MEASURED_WHEN_NONE[name][field.path])
        elif isinstance(reason := _lookup(figures, (*field.path[:-1], "not_measured", field.path[-1])), str):
            out[field.name] = not_measured(_truncate(reason))  # the stage said why (e.g. job efficiency)
        else:
            out[field.name] = not_measured(f"{name}.{'.'.join(field.path)} {why}")
    section = {"ran": True, "figures": out}
    if name == "quality":
        section["checks"] = _quality_checks(figures.get("checks"))
    if name == "training":
        section["loss_curve"] = _loss_curve(figures.get("loss_curve"))
    if name == "record":
        section["history"] = _history(figures.get("history"))
    return section


def _history(nights: Any) -> dict:
    """The last nights from MLflow: ``{"nights": [{ds, auc, rows, train_s}], "dropped": n}`` (figures that are not
    finite numbers become None; a night without a valid ds is dropped), or why there is none."""
    if nights is None:
        return {"nights": [], "dropped": 0, "why": f"{NOT_MEASURED}: MLflow's run history was not read"}
    if not isinstance(nights, list):
        return {"nights": [], "dropped": 0, "why": f"{NOT_MEASURED}: the run history is not a list"}
    kept, dropped = [], 0
    for night in nights:
        ds = night.get("ds") if isinstance(night, Mapping) else None
        if not isinstance(ds, str) or not DS_PATTERN.fullmatch(ds):
            dropped += 1
            continue
        kept.append({"ds": ds, **{key: _number(night.get(key)) for key in ("auc", "rows", "train_s")}})
    return {"nights": kept, "dropped": dropped}


def _is_explicit_none(figures: Mapping, path: tuple[str, ...]) -> bool:
    """True when the stage reported the figure (or the mapping holding it) as None on purpose."""
    node: Any = figures
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False
        node = node[key]
        if node is None:
            return True
    return False


def _check_value(value: Any) -> Any:
    number = _number(value)
    if number is not None or value is None or isinstance(value, bool):
        return number if number is not None else value
    return _truncate(str(value))


def _quality_checks(checks: Any) -> list[dict]:
    if not isinstance(checks, Sequence) or isinstance(checks, str):
        return []
    rows = []
    for check in checks[:MAX_CHECKS]:
        if isinstance(check, Mapping):
            rows.append({key: _check_value(check.get(key)) for key in CHECK_KEYS})
    return rows


def _loss_curve(points: Any) -> dict:
    """The loss curve's finite ``[step, loss]`` points; points that are not are counted, not drawn."""
    if not isinstance(points, Sequence) or isinstance(points, str):
        return {"points": [], "dropped": 0}
    kept, dropped = [], 0
    for point in points:
        is_pair = isinstance(point, Sequence) and not isinstance(point, str) and len(point) == 2
        step, loss = (_number(point[0]), _number(point[1])) if is_pair else (None, None)
        if step is None or loss is None:
            dropped += 1
        else:
            kept.append([step, loss])
    return {"points": kept, "dropped": dropped}


def _figure(sections: Mapping, section: str, name: str) -> dict:
    entry = sections[section]
    if not entry["ran"]:
        return {"value": None, "why": entry["why"]}
    return entry["figures"][name]


def _ratio_cost(numerator: dict, denominator: dict, scale: float, unit_label: str) -> dict:
    if not is_measured(numerator):
        return _carry_over(numerator)
    if not is_measured(denominator):
        return _carry_over(denominator)
    if denominator["value"] == 0:
        return not_measured(f"no {unit_label} (0)")
    units = denominator["value"] / scale
    return measured(numerator["value"] / units, "USD",
                    f"{numerator['value']:.6g} USD / ({denominator['value']:,} {unit_label} / {scale:,.0f})")


def _cpu_stage_cost(sections: Mapping, stage: str, prices: CostConfig) -> tuple[dict, dict]:
    wall, cores = _figure(sections, stage, "wall_s"), _figure(sections, stage, "executor_cores")
    for figure in (wall, cores):
        if not is_measured(figure):
            return _carry_over(figure), _carry_over(figure)
    hours = wall["value"] * cores["value"] / 3600
    return (measured(hours, "CPU-h", f"{wall['value']:.6g} s x {cores['value']} cores / 3600"),
            measured(hours * prices.cpu_hour_usd, "USD",
                     f"{hours:.6g} CPU-h x {prices.cpu_hour_usd:g} USD/CPU-h"))


def _carry_over(figure: Mapping) -> dict:
    """A derived figure that is not measured because its input is not, for the same reason."""
    return not_measured(figure["why"].removeprefix(f"{NOT_MEASURED}: "))


def build_costs(sections: Mapping, prices: CostConfig) -> dict:
    """Costs of the run from its measured figures and the prices; each names its basis or what is missing."""
    costs: dict[str, dict] = {}
    gpu_hours = _figure(sections, "training", "gpu_hours")
    side, cpu_hours = _figure(sections, "training", "placement_side"), _figure(sections, "training", "cpu_hours")
    if is_measured(side) and side["value"] == "cpu":  # no GPU held: the run cost its CPU-hours
        costs["training_run_usd"] = measured(
            cpu_hours["value"] * prices.cpu_hour_usd, "USD",
            f"{cpu_hours['value']:.6g} CPU-h x {prices.cpu_hour_usd:g} USD/CPU-h (cpu placement, no GPU)",
        ) if is_measured(cpu_hours) else _carry_over(cpu_hours)
    elif is_measured(gpu_hours):
        hours = gpu_hours["value"]
        costs["training_run_usd"] = measured(hours * prices.gpu_hour_usd, "USD",
                                             f"{hours:.6g} GPU-h x {prices.gpu_hour_usd:g} USD/GPU-h")
    else:
        costs["training_run_usd"] = _carry_over(gpu_hours)
    rows = _figure(sections, "training", "train_rows_processed")
    costs["per_million_training_rows_usd"] = _ratio_cost(costs["training_run_usd"], rows, 1e6,
                                                         "training rows")
    costs["features_cpu_hours"], costs["features_usd"] = _cpu_stage_cost(sections, "features", prices)
    costs["scoring_cpu_hours"], costs["scoring_usd"] = _cpu_stage_cost(sections, "scoring", prices)
    costs["per_1000_batch_predictions_usd"] = _ratio_cost(
        costs["scoring_usd"], _figure(sections, "scoring", "rows"), 1e3, "predictions")
    throughput = _figure(sections, "deploy", "latency_throughput_rps")
    if not is_measured(throughput):
        costs["per_1000_realtime_inferences_usd"] = _carry_over(throughput)
    elif throughput["value"] == 0:
        costs["per_1000_realtime_inferences_usd"] = not_measured("deploy.latency.throughput_rps is 0")
    else:
        per_hour = throughput["value"] * 3600
        costs["per_1000_realtime_inferences_usd"] = measured(
            prices.serving_hour_usd / per_hour * 1000, "USD",
            f"{prices.serving_hour_usd:g} USD/server-h / ({throughput['value']:.6g} req/s x 3600) x 1000")
    return costs


def build_report(figures: Mapping[str, Any], prices: CostConfig, *,
                 p99_slo_ms: float = DEFAULT_P99_SLO_MS) -> dict:
    """
    The report's JSON from the figures gathered from the stages' XComs.

    :param figures: ``dag_id``, ``run_id``, ``ds``, ``generated_at`` and one mapping (or None) per stage of
        :data:`SECTIONS`; keys outside the whitelist are ignored.
    :param prices: the prices the costs are computed with, copied into the report.
    :param p99_slo_ms: the realtime p99 latency budget, drawn on the deploy chart.
    """
    header = {}
    for key in ("dag_id", "run_id", "ds", "generated_at"):
        raw = figures.get(key)
        value, why = read_figure(raw.isoformat() if hasattr(raw, "isoformat") else raw, "text")
        header[key] = value if why is None else None
    sections = {name: build_section(name, figures.get(name)) for name in SECTIONS}
    costs = build_costs(sections, prices)
    report = {
        "format_version": REPORT_FORMAT_VERSION,
        **header,
        "prices": {"gpu_hour_usd": prices.gpu_hour_usd, "cpu_hour_usd": prices.cpu_hour_usd,
                   "serving_hour_usd": prices.serving_hour_usd},
        "slo": {"p99_ms": p99_slo_ms},
        "sections": sections,
        "costs": costs,
    }
    report["not_measured"] = list_not_measured(report)
    return report


def list_not_measured(report: Mapping) -> list[dict]:
    """Every figure of the report that is not measured, as ``{"figure": "<section>.<name>", "why": ...}``."""
    missing = []
    for name, section in report["sections"].items():
        if not section["ran"]:
            missing.append({"figure": name, "why": section["why"]})
            continue
        missing.extend({"figure": f"{name}.{key}", "why": figure["why"]}
                       for key, figure in section["figures"].items() if not is_measured(figure))
    missing.extend({"figure": f"costs.{key}", "why": figure["why"]}
                   for key, figure in report["costs"].items() if not is_measured(figure))
    return missing


def chart_plan(report: Mapping) -> dict[str, str | None]:
    """For each chart: None when it can be drawn, else why it is not."""
    sections = report["sections"]
    plan: dict[str, str | None] = {}
    training = sections["training"]
    if not training["ran"]:
        plan["loss_curve"] = training["why"]
    elif not training["loss_curve"]["points"]:
        plan["loss_curve"] = f"{NOT_MEASURED}: training.loss_curve has no finite points"
    else:
        plan["loss_curve"] = None
    evaluation = sections["evaluation"]
    if not evaluation["ran"]:
        plan["holdout_metrics"] = evaluation["why"]
    elif not any(is_measured(evaluation["figures"][key])
                 for key in ("challenger_auc", "challenger_log_loss")):
        plan["holdout_metrics"] = f"{NOT_MEASURED}: no challenger holdout metric"
    else:
        plan["holdout_metrics"] = None
    deploy = sections["deploy"]
    if not deploy["ran"]:
        plan["deploy_latency"] = deploy["why"]
    elif not any(is_measured(deploy["figures"][key]) for key in ("latency_p50_ms", "latency_p99_ms")):
        plan["deploy_latency"] = f"{NOT_MEASURED}: no latency percentile from the deploy stage"
    else:
        plan["deploy_latency"] = None
    record = sections["record"]
    if not record["ran"]:
        plan["nightly_history"] = record["why"]
    elif record["history"].get("why"):
        plan["nightly_history"] = record["history"]["why"]
    elif len(record["history"]["nights"]) < 2:
        plan["nightly_history"] = f"{NOT_MEASURED}: fewer than 2 finished nights in MLflow"
    else:
        plan["nightly_history"] = None
    return plan


def render_charts(report: Mapping, out_dir: Path) -> list[Path]:
    """Draws the charts whose data was measured as PNG files in ``out_dir``; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = chart_plan(report)
    sections = report["sections"]
    written = []
    for chart in CHARTS:
        if plan[chart.name] is not None:
            continue
        figure = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        if chart.name == "loss_curve":
            _draw_loss_curve(figure, sections["training"]["loss_curve"])
        elif chart.name == "holdout_metrics":
            _draw_holdout_metrics(figure, sections["evaluation"]["figures"])
        elif chart.name == "nightly_history":
            figure.set_size_inches(6.4, 6.0)
            _draw_history(figure, sections["record"]["history"]["nights"])
        else:
            _draw_latency(figure, sections["deploy"]["figures"], report["slo"]["p99_ms"])
        figure.suptitle(chart.title)
        path = out_dir / chart.file
        figure.savefig(path, format="png", metadata={"Software": None})
        written.append(path)
    return written


def _draw_loss_curve(figure, curve: Mapping) -> None:
    axes = figure.add_subplot()
    steps, losses = zip(*curve["points"], strict=True)
    axes.plot(steps, losses, marker="." if len(steps) < 50 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.grid(alpha=0.3)


def _draw_history(figure, nights: Sequence[Mapping]) -> None:
    """Holdout AUC, rows trained and training time per night; a night without a figure leaves a gap."""
    rows = (("auc", "holdout AUC"), ("rows", "rows trained"), ("train_s", "training time (s)"))
    labels = [night["ds"] for night in nights]
    for index, (key, label) in enumerate(rows, start=1):
        axes = figure.add_subplot(len(rows), 1, index)
        values = [float("nan") if night[key] is None else night[key] for night in nights]
        axes.plot(range(len(nights)), values, marker="o")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.set_xticks(range(len(nights)), labels if index == len(rows) else [""] * len(nights),
                        rotation=60, fontsize=7)


def _draw_holdout_metrics(figure, figures: Mapping) -> None:
    for index, metric in enumerate(("auc", "log_loss"), start=1):
        axes = figure.add_subplot(1, 2, index)
        labels, values = [], []
        for side in ("challenger", "champion"):
            figure_value = figures[f"{side}_{metric}"]
            if is_measured(figure_value):
                labels.append(side)
                values.append(figure_value["value"])
        axes.bar(labels, values, color=["#4c72b0", "#dd8452"][: len(values)])
        axes.set_title("AUC (higher is better)" if metric == "auc" else "log loss (lower is better)")
        if not values:
            axes.text(0.5, 0.5, NOT_MEASURED, ha="center", va="center", transform=axes.transAxes)
        axes.margins(y=0.15)
        for position, value in enumerate(values):
            axes.annotate(f"{value:.4f}", (position, value), ha="center", va="bottom")


def _draw_latency(figure, figures: Mapping, slo_ms: float) -> None:
    axes = figure.add_subplot()
    labels, values = [], []
    for key, label in (("latency_p50_ms", "p50"), ("latency_p99_ms", "p99")):
        if is_measured(figures[key]):
            labels.append(label)
            values.append(figures[key]["value"])
    colors = ["#4c72b0" if value <= slo_ms else "#c44e52" for value in values]
    axes.bar(labels, values, color=colors)
    axes.axhline(slo_ms, color="#c44e52", linestyle="--", label=f"p99 SLO {slo_ms:g} ms")
    axes.set_ylabel("ms")
    axes.margins(y=0.15)
    axes.legend()
    for position, value in enumerate(values):
        axes.annotate(f"{value:.1f} ms", (position, value), ha="center", va="bottom")


def format_value(figure: Mapping) -> str:
    """A figure as text: its value and unit, or why it was not measured."""
    value = figure.get("value")
    if value is None:
        return str(figure.get("why", NOT_MEASURED))
    unit = figure.get("unit")
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.6g}" if abs(value) >= 1e-4 or value == 0 else f"{value:.4g}"
    else:
        text = str(value)
    if unit == "USD":
        return f"{text} USD"
    return f"{text} {unit}" if unit and unit != "ratio" else text


HTML_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:60em}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}.nm{color:#a33}.skipped{color:#777}img{max-width:100%}"
)


def render_html(report: Mapping, chart_files: Sequence[str | Path]) -> str:
    """A self-contained HTML page of the report; every value is escaped, charts are relative ``img`` links."""
    esc = html.escape
    drawn = {Path(path).name for path in chart_files}
    plan = chart_plan(report)
    charts = {chart.name: chart for chart in CHARTS}
    chart_of_section = {"training": "loss_curve", "evaluation": "holdout_metrics", "deploy": "deploy_latency",
                        "record": "nightly_history"}
    title = f"Run report: {report.get('dag_id') or '?'} {report.get('run_id') or '?'}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
        f"<style>{HTML_STYLE}</style></head><body>", f"<h1>{esc(title)}</h1>",
        "<table>",
        *(f"<tr><th>{esc(label)}</th><td>{esc(str(report.get(key) or NOT_MEASURED))}</td></tr>"
          for key, label in (("dag_id", "DAG"), ("run_id", "Run"), ("ds", "Data interval (ds)"),
                             ("generated_at", "Generated at"))),
        "</table>",
        "<h2>Costs</h2>", _costs_table(report), _prices_line(report),
    ]
    for name, (heading, spec) in SECTIONS.items():
        section = report["sections"][name]
        parts.append(f"<h2>{esc(heading)}</h2>")
        if not section["ran"]:
            parts.append(f'<p class="skipped">{esc(section["why"])}</p>')
        else:
            parts.append(_figures_table(section["figures"], spec))
            if name == "quality":
                parts.append(_checks_table(section["checks"]))
            if name == "training":
                curve = section["loss_curve"]
                parts.append(f"<p>Loss curve: {len(curve['points'])} points"
                             + (f", {curve['dropped']} not finite and not drawn" if curve["dropped"] else "")
                             + "</p>")
        chart_name = chart_of_section.get(name)
        if chart_name:
            chart = charts[chart_name]
            if chart.file in drawn:
                parts.append(f'<p><img src="{esc(chart.file)}" alt="{esc(chart.title)}"></p>')
            else:
                why = plan[chart_name] or "the chart was not drawn"
                parts.append(f'<p class="nm">{esc(chart.title)}: chart not drawn ({esc(why)})</p>')
    parts.append("<h2>Not measured</h2>")
    if report["not_measured"]:
        parts.append("<ul>" + "".join(f"<li><code>{esc(item['figure'])}</code>: {esc(item['why'])}</li>"
                                      for item in report["not_measured"]) + "</ul>")
    else:
        parts.append("<p>Every figure was measured.</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _figure_cell(figure: Mapping) -> str:
    css = "" if is_measured(figure) else ' class="nm"'
    return f"<td{css}>{html.escape(format_value(figure))}</td>"


def _link_cell(figure: Mapping) -> str:
    url = html.escape(figure["value"])
    return f'<td><a href="{url}">{url}</a></td>'


def _figures_table(figures: Mapping, spec: Sequence[Field]) -> str:
    rows = "".join(f"<tr><th>{html.escape(field.label)}</th>{_link_cell(figures[field.name])}</tr>"
                   if field.kind == "link" and is_measured(figures[field.name]) else
                   f"<tr><th>{html.escape(field.label)}</th>{_figure_cell(figures[field.name])}</tr>"
                   for field in spec)
    return f"<table>{rows}</table>"


def _costs_table(report: Mapping) -> str:
    rows = []
    for key, figure in report["costs"].items():
        basis = figure.get("basis", "")
        rows.append(f"<tr><th>{html.escape(COST_LABELS[key])}</th>{_figure_cell(figure)}"
                    f"<td>{html.escape(basis)}</td></tr>")
    return "<table><tr><th>Cost</th><th>Value</th><th>Basis</th></tr>" + "".join(rows) + "</table>"


def _prices_line(report: Mapping) -> str:
    prices = report["prices"]
    return (f"<p>Prices (from the pipeline config): {prices['gpu_hour_usd']:g} USD per GPU-hour, "
            f"{prices['cpu_hour_usd']:g} USD per CPU-hour, {prices['serving_hour_usd']:g} USD per inference "
            f"server-hour.</p>")


def _checks_table(checks: Sequence[Mapping]) -> str:
    if not checks:
        return f'<p class="nm">{NOT_MEASURED}: the gate reported no checks</p>'
    head = "".join(f"<th>{key}</th>" for key in CHECK_KEYS)
    rows = []
    for check in checks:
        cells = "".join(
            f"<td>{html.escape('' if check[key] is None else str(check[key]))}</td>" for key in CHECK_KEYS)
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def write_report(report_dir: Path, figures: Mapping[str, Any], prices: CostConfig, *,
                 p99_slo_ms: float = DEFAULT_P99_SLO_MS) -> dict[str, Any]:
    """
    Builds the report and publishes ``report.json``, ``report.html`` and the charts into ``report_dir``
    together: everything is written into a hidden staging directory beside it, which is then renamed into
    place; an earlier report in ``report_dir`` is renamed aside first and deleted after the swap, so a rerun
    replaces the whole report and never mixes old and new files.

    :return: ``{"dir", "json", "html", "charts": [...], "not_measured": [...]}`` (paths as strings).
    """
    report_dir = Path(report_dir)
    report = build_report(figures, prices, p99_slo_ms=p99_slo_ms)
    with staged_dir(report_dir) as staging:
        charts = render_charts(report, staging)
        (staging / JSON_NAME).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        (staging / HTML_NAME).write_text(render_html(report, [chart.name for chart in charts]))
    return {
        "dir": str(report_dir),
        "json": str(report_dir / JSON_NAME),
        "html": str(report_dir / HTML_NAME),
        "charts": [str(report_dir / chart.name) for chart in charts],
        "not_measured": report["not_measured"],
    }
