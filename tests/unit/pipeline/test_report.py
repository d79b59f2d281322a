"""Publishing the run report (hybridflow.pipeline.report.write_report): JSON, HTML and charts together, a rerun
replacing the earlier report whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers.report_figures import FIGURES, PRICES, assert_png, figures_with
from hybridflow.layout import StorageLayout
from hybridflow.pipeline.report import write_report


def test_report_write_publishes_json_html_and_charts(tmp_path):
    target = Path(StorageLayout(str(tmp_path)).report_dir("nightly_training", FIGURES["ds"], FIGURES["run_id"]))
    run = "scheduled__2026-01-05T00_00_00_00_00"
    assert target == tmp_path / "reports" / "nightly_training" / "ds=2026-01-05" / run
    paths = write_report(target, FIGURES, PRICES)
    assert sorted(os.listdir(target)) == ["deploy_latency.png", "holdout_metrics.png", "loss_curve.png",
                                          "nightly_history.png", "report.html", "report.json"]
    assert json.loads((target / "report.json").read_text())["run_id"] == FIGURES["run_id"]
    assert paths["html"] == str(target / "report.html") and len(paths["charts"]) == 4
    for chart in paths["charts"]:
        assert_png(target / os.path.basename(chart))


def test_report_rewrite_replaces_the_earlier_report_atomically(tmp_path):
    target = tmp_path / "reports" / "nightly_training" / "run1"
    write_report(target, FIGURES, PRICES)
    (target / "stale-extra-file.txt").write_text("from an earlier writer")
    rerun = figures_with(deploy=None, training__state="FAILED")
    paths = write_report(target, rerun, PRICES)
    assert sorted(os.listdir(target)) == ["holdout_metrics.png", "loss_curve.png", "nightly_history.png",
                                          "report.html", "report.json"]
    report = json.loads((target / "report.json").read_text())
    assert report["sections"]["training"]["figures"]["state"]["value"] == "FAILED"
    assert not report["sections"]["deploy"]["ran"]
    assert paths["not_measured"] == report["not_measured"]
    assert sorted(os.listdir(target.parent)) == ["run1"], "no staging or retired directory is left behind"
