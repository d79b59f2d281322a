"""The run report's HTML page (hybridflow.pipeline.report.page): every value escaped, only plain http links, and
why a chart is missing."""

from __future__ import annotations

import pytest
from helpers.report_figures import FIGURES, PRICES, figures_with
from hybridflow.pipeline.report.figures import build_report, is_measured
from hybridflow.pipeline.report.page import render_html

HOSTILE = '<script>alert("x")</script>'


@pytest.mark.parametrize(
    "changes",
    [
        {"run_id": HOSTILE},
        {"dag_id": HOSTILE},
        {"evaluation__reason": HOSTILE},
        {"deploy__model": HOSTILE},
        {"quality__checks": [{"name": HOSTILE, "column": "c", "observed": HOSTILE, "expected": 1,
                              "passed": False}]},
    ],
    ids=["run_id", "dag_id", "reason", "model", "check"],
)
def test_report_html_escapes_hostile_strings(changes):
    page = render_html(build_report(figures_with(**changes), PRICES), [])
    assert "<script>" not in page
    assert "&lt;script&gt;" in page


def test_report_html_says_why_a_chart_is_missing_and_links_drawn_ones():
    report = build_report(figures_with(deploy=None, training__loss_curve=[]), PRICES)
    page = render_html(report, ["holdout_metrics.png"])
    assert '<img src="holdout_metrics.png"' in page
    assert "Training loss: chart not drawn (not measured: training.loss_curve has no finite points)" in page
    assert "chart not drawn (not measured: the deploy stage did not run in this run)" in page


@pytest.mark.parametrize("url", [
    "javascript:alert(1)", 'http://h/"onmouseover="x', "http://h/<script>", "http://user:pw@h/x", "ftp://h/x",
    "http://h/ x", "//h/x", 42, None,
], ids=ascii)
def test_report_links_only_plain_http_addresses(url):
    figures = {**FIGURES, "record": {**FIGURES["record"], "run_url": url}}
    report = build_report(figures, PRICES)
    assert not is_measured(report["sections"]["record"]["figures"]["run_url"])
    page = render_html(report, [])
    assert "<a href" not in page and "<script>" not in page and "javascript:" not in page


def test_report_links_the_mlflow_run():
    page = render_html(build_report(FIGURES, PRICES), [])
    url = FIGURES["record"]["run_url"]
    assert f'<a href="{url}">{url}</a>' in page and "models:/propensity/7" in page


def test_report_html_shows_the_placement_decision():
    html = render_html(build_report(FIGURES, PRICES), [])
    assert "Placement (CPU or GPU, from measured figures)" in html and "large: GPU 50x faster" in html
