"""The report's figures: what each stage measured, what the run cost, and what could not be measured.

A measured figure is ``{"value": v, "unit": u}``; a figure that is absent, None, not finite or of the wrong type is
``{"value": null, "why": "not measured: ..."}``, and so is every derived figure (a cost) whose input is missing,
naming the input. A section may be None (the stage was skipped: a backfill does not train or deploy). Every
figure not measured is also listed in the report's ``not_measured``. Nothing in the report is invented.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.config import CostConfig, ServingConfig
from hybridflow.pipeline.report.sections import CHECK_KEYS, NOT_MEASURED_WHEN_NONE, SECTIONS

REPORT_FORMAT_VERSION = 1
DEFAULT_P99_SLO_MS = ServingConfig.slo_p99_ms
MAX_TEXT_CHARS = 200
MAX_CHECKS = 200
NOT_MEASURED = "not measured"

DS_PATTERN = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# A link the report renders as <a href>: http(s), a host, then only characters that need no escaping in a URL
SAFE_LINK = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/#-]*)?")


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
