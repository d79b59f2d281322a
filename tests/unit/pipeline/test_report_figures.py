"""The run report's figures (hybridflow.pipeline.report.figures): costs, "not measured" and its reasons, the
whitelist, the loss curve and the nights from MLflow."""

from __future__ import annotations

import json
import math

import pytest
from helpers.report_figures import FIGURES, NIGHTS_WITH_GAPS, PRICES, figures_with
from hybridflow.config import CostConfig
from hybridflow.exceptions import ConfigError
from hybridflow.pipeline.report.figures import build_report


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
        ({"deploy__release": None}, "deploy.release_decision",
         "no release steps (first deploy, the version already served, or serving.release.strategy: direct)"),
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


def test_report_loss_curve_counts_points_it_cannot_draw():
    report = build_report(figures_with(training__loss_curve=[[0, 0.7], [1, float("inf")], [2, 0.6]]), PRICES)
    assert report["sections"]["training"]["loss_curve"] == {"points": [[0, 0.7], [2, 0.6]], "dropped": 1}


def test_the_30_nights_keep_gaps_for_missing_figures():
    report = build_report({**FIGURES, "record": {**FIGURES["record"], "history": NIGHTS_WITH_GAPS}}, PRICES)
    history = report["sections"]["record"]["history"]
    assert history["dropped"] == 1 and history["nights"][1] == {"ds": "2026-01-02", "auc": None, "rows": None,
                                                                "train_s": 61.0}
