"""The run report: what each stage of a pipeline run measured, what it cost, and what could not be measured.

:func:`~figures.build_report` turns the figures gathered from the stages' XComs into the report's JSON
(:mod:`.sections` whitelists what it may read), :func:`~charts.render_charts` and :func:`~page.render_html` draw
it, and :func:`write_report` publishes ``report.json``, ``report.html`` and the PNG charts together, replacing an
earlier report of the same run. Standard library only, except matplotlib, imported when charts are drawn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.atomic import staged_dir
from hybridflow.config import CostConfig
from hybridflow.pipeline.report.charts import render_charts
from hybridflow.pipeline.report.figures import DEFAULT_P99_SLO_MS, build_report
from hybridflow.pipeline.report.page import render_html

JSON_NAME = "report.json"
HTML_NAME = "report.html"


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
