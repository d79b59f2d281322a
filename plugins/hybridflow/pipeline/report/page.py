"""The report's HTML page: self-contained, every value escaped, the charts linked as relative ``img`` files."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path

from hybridflow.pipeline.report.charts import CHARTS, chart_plan
from hybridflow.pipeline.report.figures import NOT_MEASURED, is_measured
from hybridflow.pipeline.report.sections import CHECK_KEYS, SECTIONS, Field

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
