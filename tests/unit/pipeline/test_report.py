"""Tables for the run report (hybridflow.pipeline.report): costs, "not measured", escaping, charts, rewrites."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
from helpers.nested import change_at
from hybridflow.exceptions import ConfigError
from hybridflow.layout import StorageLayout
from hybridflow.pipeline.report import (
    CostConfig,
    build_report,
    chart_plan,
    is_measured,
    render_charts,
    render_html,
    write_report,
)

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
                           "throughput_rps": 500.0, "failed": 0}},
}


def figures_with(**changes) -> dict:
    """FIGURES with dotted paths replaced; a value of ``...`` deletes the key."""
    figures = copy.deepcopy(FIGURES)
    for dotted, value in changes.items():
        change_at(figures, dotted.split("__"), value, delete_marker=...)
    return figures


# Hand-computed: 8 GPU-h x 2.5 = 20 USD; 20 / 4 M rows = 5 USD per M; features 1800 s x 4 cores = 2 CPU-h
# x 0.05 = 0.1 USD; scoring 360 s x 10 cores = 1 CPU-h = 0.05 USD, / 2,000 thousands = 2.5e-5 USD per 1,000;
# serving 1.2 USD per hour / (500 req/s x 3600) x 1000 = 1/1500 USD per 1,000 inferences.
@pytest.mark.parametrize(
    "cost, expected",
    [
        ("training_run_usd", 20.0),
        ("per_million_training_rows_usd", 5.0),
        ("features_cpu_hours", 2.0),
        ("features_usd", 0.1),
        ("scoring_cpu_hours", 1.0),
        ("scoring_usd", 0.05),
        ("per_1000_batch_predictions_usd", 2.5e-5),
        ("per_1000_realtime_inferences_usd", 1 / 1500),
    ],
)
def test_report_costs_from_known_figures(cost, expected):
    figure = build_report(FIGURES, PRICES)["costs"][cost]
    assert math.isclose(figure["value"], expected, rel_tol=1e-12)
    assert figure["basis"]


def test_report_with_every_figure_measured_lists_nothing_as_not_measured():
    report = build_report(FIGURES, PRICES)
    assert report["not_measured"] == []
    assert report["sections"]["training"]["figures"]["gpu_hours"] == {"value": 8.0, "unit": "GPU-h"}
    assert report["prices"] == {"gpu_hour_usd": 2.5, "cpu_hour_usd": 0.05, "serving_hour_usd": 1.2}


@pytest.mark.parametrize(
    "changes, figure, why",
    [
        ({"training": None}, "costs.training_run_usd", "the training stage did not run"),
        ({"training": None}, "costs.per_million_training_rows_usd", "the training stage did not run"),
        ({"training__gpu_hours": ...}, "costs.training_run_usd", "training.gpu_hours missing"),
        ({"training__train_rows_processed": None}, "costs.per_million_training_rows_usd",
         "training.train_rows_processed missing"),
        ({"training__train_rows_processed": 0}, "costs.per_million_training_rows_usd",
         "no training rows (0)"),
        ({"training__mean_gpu_utilization_pct": None}, "training.mean_gpu_utilization_pct", "no GPU sampled"),
        ({"training__mean_gpu_utilization_pct": ...}, "training.mean_gpu_utilization_pct",
         "training.mean_gpu_utilization_pct missing"),
        ({"training__gpu_hours": float("nan")}, "training.gpu_hours",
         "training.gpu_hours not a finite number"),
        ({"training__gpus": "eight"}, "training.gpus", "training.gpus not a number (str)"),
        ({"training__restarts": -1}, "training.restarts", "not a non-negative whole number"),
        # job efficiency: the reason Slurm's accounting gave, else that the figure is missing
        ({"training__efficiency__cpu_efficiency": None,
          "training__efficiency__not_measured": {"cpu_efficiency": "the cluster records no per-step usage"}},
         "training.cpu_efficiency", "the cluster records no per-step usage"),
        ({"training__efficiency": None}, "training.queue_wait_s", "training.efficiency.queue_wait_s missing"),
        ({"training__time_split": None}, "training.time_split", "the job wrote no time split"),
        ({"training__efficiency__max_rss_gib": "big"}, "training.max_rss_gib",
         "training.efficiency.max_rss_gib not a number (str)"),
        ({"features__executor_cores": ...}, "costs.features_usd", "features.executor_cores missing"),
        ({"features__wall_s": None}, "costs.features_cpu_hours", "features.wall_s missing"),
        ({"scoring": None}, "costs.per_1000_batch_predictions_usd", "the scoring stage did not run"),
        ({"scoring__rows": ...}, "costs.per_1000_batch_predictions_usd", "scoring.rows missing"),
        ({"deploy": None}, "costs.per_1000_realtime_inferences_usd", "the deploy stage did not run"),
        ({"deploy__latency": ...}, "costs.per_1000_realtime_inferences_usd",
         "deploy.latency.throughput_rps missing"),
        ({"deploy__latency__throughput_rps": 0}, "costs.per_1000_realtime_inferences_usd",
         "throughput_rps is 0"),
        ({"deploy__previous_version": None}, "deploy.previous_version", "no previous version (first deploy)"),
        ({"evaluation__champion": None}, "evaluation.champion_auc", "no champion (first model)"),
        ({"evaluation__champion": ...}, "evaluation.champion_auc", "evaluation.champion.auc missing"),
        ({"quality": None}, "quality", "the quality stage did not run"),
        ({"placement": None}, "placement", "the placement stage did not run"),
        ({"placement__cpu__rows_per_s": None}, "placement.cpu_rows_per_s",
         "no CPU figure for the preset in pipeline.yaml placement.training"),
        ({"placement__gpu_speedup": None}, "placement.gpu_speedup", "a side's throughput is not measured"),
        ({"placement__evaluation": None}, "placement.evaluation_partition",
         "the evaluation was not planned (no prepare result)"),
        ({"placement__evaluation__cpu_s": None}, "placement.evaluation_cpu_s",
         "the CPU scoring rate or the holdout size is not measured"),
        ({"training__placement_side": "cpu", "training__cpu_hours": None}, "costs.training_run_usd",
         "training.cpu_hours missing"),
    ],
)
def test_report_missing_inputs_are_not_measured_with_the_reason(changes, figure, why):
    report = build_report(figures_with(**changes), PRICES)
    reasons = {item["figure"]: item["why"] for item in report["not_measured"]}
    assert figure in reasons, reasons
    assert reasons[figure].startswith("not measured: ") and why in reasons[figure]
    section, _, name = figure.partition(".")
    if section == "costs":
        assert report["costs"][name]["value"] is None and report["costs"][name]["why"] == reasons[figure]


def test_report_prices_a_cpu_placement_by_its_cpu_hours():
    """A run placed on the CPU partition held no GPU: its training cost is CPU-hours x the CPU price."""
    report = build_report(figures_with(training__placement_side="cpu", training__gpus=0, training__gpu_hours=0.0,
                                       training__cpu_hours=4.0), PRICES)
    cost = report["costs"]["training_run_usd"]
    assert cost["value"] == pytest.approx(0.2) and "4 CPU-h x 0.05 USD/CPU-h (cpu placement, no GPU)" in cost["basis"]
    assert report["costs"]["per_million_training_rows_usd"]["value"] == pytest.approx(0.05)
    html = render_html(report, [])
    assert "Placement (CPU or GPU, from measured figures)" in html and "large: GPU 50x faster" in html


def test_report_skipped_stages_give_no_zero_costs():
    backfill = figures_with(training=None, evaluation=None, deploy=None)
    report = build_report(backfill, PRICES)
    for name in ("training_run_usd", "per_million_training_rows_usd", "per_1000_realtime_inferences_usd"):
        assert report["costs"][name]["value"] is None
    assert report["costs"]["scoring_usd"]["value"] == pytest.approx(0.05)
    assert {item["figure"] for item in report["not_measured"]} >= {"training", "evaluation", "deploy"}


def test_report_reads_only_whitelisted_figures():
    leaky = figures_with(training__ssh_password="hunter2", deploy__headers={"Authorization": "Bearer s3cr3t"},
                         extra_section={"token": "abc"})
    text = json.dumps(build_report(leaky, PRICES))
    assert "hunter2" not in text and "s3cr3t" not in text and "extra_section" not in text


@pytest.mark.parametrize(
    "prices, fragment",
    [
        ({"gpu_hour_usd": -1.0, "cpu_hour_usd": 0.05, "serving_hour_usd": 1.0},
         "gpu_hour_usd: -1.0; a price cannot be negative"),
        ({"gpu_hour_usd": 1.0, "cpu_hour_usd": "0.05", "serving_hour_usd": 1.0},
         "cpu_hour_usd: expected a finite"),
        ({"gpu_hour_usd": 1.0, "cpu_hour_usd": 0.05, "serving_hour_usd": float("inf")}, "serving_hour_usd"),
        ({"gpu_hour_usd": True, "cpu_hour_usd": 0.05, "serving_hour_usd": 1.0}, "gpu_hour_usd"),
    ],
)
def test_report_prices_are_validated(prices, fragment):
    with pytest.raises(ConfigError, match="costs") as err:
        CostConfig(**prices)
    assert fragment in str(err.value)


def test_report_free_prices_are_allowed():
    report = build_report(FIGURES, CostConfig(0, 0, 0))
    assert report["costs"]["training_run_usd"]["value"] == 0


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


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE), path


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


def test_report_loss_curve_counts_points_it_cannot_draw():
    report = build_report(figures_with(training__loss_curve=[[0, 0.7], [1, float("inf")], [2, 0.6]]), PRICES)
    assert report["sections"]["training"]["loss_curve"] == {"points": [[0, 0.7], [2, 0.6]], "dropped": 1}


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
    nights = [{"ds": "2026-01-01", "auc": 0.8, "rows": 1e6, "train_s": 60.0},
              {"ds": "2026-01-02", "auc": None, "rows": float("nan"), "train_s": 61.0}, {"ds": 3}]
    report = build_report({**FIGURES, "record": {**FIGURES["record"], "history": nights}}, PRICES)
    history = report["sections"]["record"]["history"]
    assert history["dropped"] == 1 and history["nights"][1] == {"ds": "2026-01-02", "auc": None, "rows": None,
                                                                "train_s": 61.0}
    drawn = render_charts(report, tmp_path)
    chart = tmp_path / "nightly_history.png"
    assert chart in drawn and chart.read_bytes().startswith(PNG_SIGNATURE)
    assert '<img src="nightly_history.png"' in render_html(report, [path.name for path in drawn])
