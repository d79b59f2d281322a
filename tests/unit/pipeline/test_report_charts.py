"""The run report's charts (hybridflow.pipeline.report.charts): drawn as PNGs from measured figures only, and
why each chart that is not drawn is not."""

from __future__ import annotations

import pytest
from helpers.report_figures import FIGURES, NIGHTS_WITH_GAPS, PNG_SIGNATURE, PRICES, assert_png, figures_with
from hybridflow.pipeline.report.charts import chart_plan, render_charts
from hybridflow.pipeline.report.figures import build_report
from hybridflow.pipeline.report.page import render_html


def test_report_charts_are_valid_pngs(tmp_path):
    files = render_charts(build_report(FIGURES, PRICES), tmp_path)
    assert sorted(path.name for path in files) == ["deploy_latency.png", "holdout_metrics.png",
                                                    "loss_curve.png", "nightly_history.png"]
    for path in files:
        assert_png(path)


@pytest.mark.parametrize(
    "changes, not_drawn",
    [
        ({"training": None}, "loss_curve"),
        ({"training__loss_curve": [[0, float("nan")], ["a", 1]]}, "loss_curve"),
        ({"evaluation__challenger": {}}, "holdout_metrics"),
        ({"deploy__latency": {"requests": 10}}, "deploy_latency"),
    ],
)
def test_report_chart_without_data_is_not_drawn(tmp_path, changes, not_drawn):
    report = build_report(figures_with(**changes), PRICES)
    assert chart_plan(report)[not_drawn].startswith("not measured: ")
    assert f"{not_drawn}.png" not in {path.name for path in render_charts(report, tmp_path)}


@pytest.mark.parametrize(("history", "why"), [
    (None, "MLflow's run history was not read"),
    ([], "fewer than 2 finished nights"),
    ([{"ds": "2026-01-01", "auc": 0.8}], "fewer than 2 finished nights"),
    ([{"ds": "not a day", "auc": 0.8}, {"ds": "2026-01-01<script>", "auc": 0.8}], "fewer than 2 finished nights"),
    ("2026-01-01", "the run history is not a list"),
], ids=["not-read", "empty", "one-night", "bad-days", "not-a-list"])
def test_the_30_nights_chart_says_why_it_is_not_drawn(tmp_path, history, why):
    figures = {**FIGURES, "record": {**FIGURES["record"], "history": history}}
    report = build_report(figures, PRICES)
    assert why in chart_plan(report)["nightly_history"]
    assert "nightly_history.png" not in {path.name for path in render_charts(report, tmp_path)}


def test_the_30_nights_chart_is_drawn_with_gaps_for_missing_figures(tmp_path):
    report = build_report({**FIGURES, "record": {**FIGURES["record"], "history": NIGHTS_WITH_GAPS}}, PRICES)
    drawn = render_charts(report, tmp_path)
    chart = tmp_path / "nightly_history.png"
    assert chart in drawn and chart.read_bytes().startswith(PNG_SIGNATURE)
    assert '<img src="nightly_history.png"' in render_html(report, [path.name for path in drawn])
