"""The report's PNG charts, drawn only from measured figures; each chart not drawn says why. matplotlib is imported
only when charts are drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.pipeline.report.figures import NOT_MEASURED, is_measured


def _no_loss_points(training: Mapping) -> str | None:
    return None if training["loss_curve"]["points"] else f"{NOT_MEASURED}: training.loss_curve has no finite points"


def _no_holdout_metric(evaluation: Mapping) -> str | None:
    if any(is_measured(evaluation["figures"][key]) for key in ("challenger_auc", "challenger_log_loss")):
        return None
    return f"{NOT_MEASURED}: no challenger holdout metric"


def _no_latency(deploy: Mapping) -> str | None:
    if any(is_measured(deploy["figures"][key]) for key in ("latency_p50_ms", "latency_p99_ms")):
        return None
    return f"{NOT_MEASURED}: no latency percentile from the deploy stage"


def _too_few_nights(record: Mapping) -> str | None:
    if record["history"].get("why"):
        return record["history"]["why"]
    return None if len(record["history"]["nights"]) >= 2 else f"{NOT_MEASURED}: fewer than 2 finished nights in MLflow"


@dataclass(frozen=True)
class Chart:
    name: str
    file: str
    title: str
    section: str  # the report section it draws from; a section that did not run says why for it
    why_not: Callable[[Mapping], str | None]  # of a section that ran: why its figures cannot be drawn, or None


CHARTS = (
    Chart("loss_curve", "loss_curve.png", "Training loss", "training", _no_loss_points),
    Chart("holdout_metrics", "holdout_metrics.png", "Holdout metrics: challenger vs champion", "evaluation",
          _no_holdout_metric),
    Chart("deploy_latency", "deploy_latency.png", "Realtime latency vs SLO", "deploy", _no_latency),
    Chart("nightly_history", "nightly_history.png", "Last 30 nights (MLflow)", "record", _too_few_nights),
)


def chart_plan(report: Mapping) -> dict[str, str | None]:
    """For each chart: None when it can be drawn, else why it is not."""
    sections = report["sections"]
    return {chart.name: chart.why_not(sections[chart.section]) if sections[chart.section]["ran"]
            else sections[chart.section]["why"] for chart in CHARTS}


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
