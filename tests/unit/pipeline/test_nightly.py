"""The nightly pipeline's decisions: what a run does, what it trains on, when it deploys, what it reports."""

from __future__ import annotations

import pytest
from hybridflow.pipeline.champion import FIRST_MODEL, KEEP_CHAMPION, PROMOTE, decide
from hybridflow.pipeline.nightly import (
    features_figures,
    placement_figures,
    plan_run,
    should_deploy,
    strategy_text,
    training_figures,
    training_window,
    zero_stage_for,
)


@pytest.mark.parametrize(
    "run_type, params, train, deploy",
    [
        ("scheduled", {}, True, "auto"),
        ("manual", {"train": "auto"}, True, "auto"),
        ("backfill", {}, False, "never"),
        ("backfill", {"train": "always"}, True, "never"),
        ("backfill", {"deploy": "always"}, False, "always"),
        ("scheduled", {"train": "never", "deploy": "never"}, False, "never"),
        ("scheduled", {"deploy": "ask"}, True, "ask"),
        ("backfill", {"deploy": "ask"}, False, "never"),  # a backfill re-scores history; it never asks to deploy
    ],
)
def test_plan_run_trains_except_in_backfills_unless_asked(run_type, params, train, deploy):
    plan = plan_run(run_type, params, "2026-03-04")
    assert (plan.train, plan.deploy_mode) == (train, deploy)
    assert plan.reason


def test_plan_run_refuses_an_unknown_mode_naming_the_param():
    with pytest.raises(ValueError, match=r"param train='sometimes': choose one of auto, always, never$"):
        plan_run("manual", {"train": "sometimes"}, "2026-03-04")
    with pytest.raises(ValueError, match=r"param train='ask': choose one of auto, always, never$"):
        plan_run("manual", {"train": "ask"}, "2026-03-04")  # only a deploy is asked for
    with pytest.raises(ValueError, match=r"param deploy='later': choose one of auto, always, never, ask"):
        plan_run("manual", {"deploy": "later"}, "2026-03-04")


@pytest.mark.parametrize(
    "ds, days, published, expected",
    [
        ("2026-03-04", 7, ["2026-03-04"], ["2026-03-04"]),
        ("2026-03-04", 2, ["2026-03-02", "2026-03-03", "2026-03-04", "2026-03-05"], ["2026-03-03", "2026-03-04"]),
        ("2026-03-01", 3, ["2026-02-27", "2026-02-28", "2026-03-01"], ["2026-02-27", "2026-02-28", "2026-03-01"]),
    ],
)
def test_training_window_takes_published_days_ending_at_ds(ds, days, published, expected):
    assert training_window(ds, days, published) == expected


def test_training_window_requires_the_runs_own_partition():
    with pytest.raises(ValueError, match="features/ds=2026-03-04 is not published"):
        training_window("2026-03-04", 7, ["2026-03-03"])


@pytest.mark.parametrize(
    "mode, promoted, champion, serving, deploy",
    [
        ("auto", 3, 3, [2], True),
        ("auto", None, 3, [3], False),
        ("auto", None, 3, [], True),
        ("auto", None, None, [], False),
        ("never", 3, 3, [], False),
        ("always", None, 3, [3], True),
        ("ask", 3, 3, [2], True),  # as auto decides; the promotion is then asked
        ("ask", None, 3, [3], False),
    ],
)
def test_should_deploy(mode, promoted, champion, serving, deploy):
    decision, reason = should_deploy(mode, promoted, champion, serving)
    assert decision is deploy and reason


def evaluation(challenger_auc, champion_auc=None, rows=500):
    return {"holdout_rows": rows, "challenger": {"auc": challenger_auc, "log_loss": 0.4},
            "champion": None if champion_auc is None else {"auc": champion_auc, "log_loss": 0.45}}


@pytest.mark.parametrize(
    "result, margin, decision",
    [
        (evaluation(0.80), 0.002, FIRST_MODEL),
        (evaluation(0.80, 0.79), 0.002, PROMOTE),
        (evaluation(0.791, 0.79), 0.002, KEEP_CHAMPION),
        (evaluation(0.792, 0.79), 0.002, PROMOTE),
        (evaluation(0.70, 0.79), 0.0, KEEP_CHAMPION),
        (evaluation(None, 0.79), 0.0, KEEP_CHAMPION),
        (evaluation(0.7, None) | {"champion": {"auc": None, "log_loss": None}}, 0.0, PROMOTE),
    ],
)
def test_champion_challenger_promotes_only_when_better_by_the_margin(result, margin, decision):
    outcome = decide(result, margin, champion_version=4)
    assert outcome.decision == decision
    assert outcome.promotes is (decision != KEEP_CHAMPION)


def test_champion_challenger_reason_names_both_figures_and_the_margin():
    reason = decide(evaluation(0.7912, 0.79), 0.002, champion_version=4).reason
    assert "0.7912" in reason and "v4" in reason and "0.7900" in reason and "margin 0.0020" in reason


def test_figures_say_none_rather_than_inventing_values():
    assert features_figures(None, 2) is None
    assert training_figures(None, None) is None
    figures = training_figures({"job_id": "7", "alloc_tres": {"gres/gpu": "1"}, "metrics": {"auc": 0.8},
                                "utilization": {"gpu_hours": 0.01, "mean_utilization_pct": None}}, None)
    assert figures["gpus"] == 1 and figures["mean_gpu_utilization_pct"] is None and figures["loss_curve"] is None
    manifest = {"row_count": 90, "quarantine": {"rows": 10, "ratio": 0.1}, "input": {"raw_rows": 100},
                "job": {"seconds": 4.5}}
    ranks = training_figures(
        {"job_id": "8", "metrics": {"world_size": 2, "nodes": 2, "ranks": ["0@n1", "1@n2"], "zero_stage": 1,
                                    "allreduce_share_in_job": 0.07,
                                    "gpus_sampled": [{"host": "n1", "index": 3, "mean_utilization_pct": 81.4},
                                                     {"host": "n2", "index": 0, "mean_utilization_pct": None}]}},
        None, "all-reduce 1.0 ms vs compute 9.0 ms per step = 10.0% of a step")
    assert (ranks["ranks"], ranks["nodes"], ranks["rank_placement"]) == (2, 2, "0@n1, 1@n2")
    assert ranks["allreduce_share_in_job"] == 0.07 and ranks["allreduce_preflight"].endswith("10.0% of a step")
    assert ranks["gpu_utilization_per_gpu"] == "n1:3 81%, n2:0 n/a"
    assert figures["rank_placement"] is None and figures["gpu_utilization_per_gpu"] is None
    curve = training_figures({"job_id": "7"}, {"loss_curve": [{"step": 10, "loss": 0.5}, {"step": 20, "loss": 0.4}]})
    assert curve["loss_curve"] == [[10, 0.5], [20, 0.4]]
    assert features_figures(manifest, 2) == {"raw_rows": 100, "feature_rows": 90, "quarantined_rows": 10,
                                             "quarantine_ratio": 0.1, "customers": 90, "wall_s": 4.5,
                                             "executor_cores": 2}


def test_plan_run_carries_the_placement_it_was_given():
    placement = {"side": "cpu", "partition": "cpu", "gpus_per_node": 0, "reason": "small: ... -> cpu partition"}
    plan = plan_run("manual", {}, "2026-03-04", placement=placement)
    assert plan.placement == placement and plan.as_dict()["placement"] == placement
    assert plan_run("manual", {}, "2026-03-04").placement is None


@pytest.mark.parametrize("result, side, gpus, cpus, cpu_hours", [
    ({"placement_side": "cpu", "partition": "cpu", "elapsed_s": 1800.0, "alloc_tres": {"cpu": "4", "node": "1"}},
     "cpu", 0, 4, 2.0),
    ({"placement_side": "gpu", "elapsed_s": 3600.0, "alloc_tres": {"cpu": "2", "gres/gpu": "1"}}, "gpu", 1, 2, 2.0),
    ({"elapsed_s": 60.0, "alloc_tres": {"gres/gpu": "2"}}, "gpu", 2, None, None),  # before placement: the GPU side
    ({"placement_side": "gpu", "elapsed_s": None, "alloc_tres": {}}, "gpu", None, None, None),
], ids=["cpu-placement", "gpu-placement", "older-result", "nothing-allocated-known"])
def test_training_figures_by_placement(result, side, gpus, cpus, cpu_hours):
    figures = training_figures({"job_id": "9", **result}, None)
    assert (figures["placement_side"], figures["gpus"], figures["cpus"]) == (side, gpus, cpus)
    assert figures["cpu_hours"] == (pytest.approx(cpu_hours) if cpu_hours is not None else None)


def test_placement_figures_for_the_report():
    training = {"device": "auto", "side": "cpu", "partition": "cpu", "gpus_per_node": 0, "ranks_per_node": 1,
                "rule": "cheaper", "reason": "small: ... -> cpu partition", "gpu_speedup": 0.5, "min_gpu_speedup": 10,
                "cpu": {"side": "cpu", "rows_per_s": 80000.0, "usd_per_hour": 0.1, "usd_per_1k_rows": 3.5e-7,
                        "measured": "2-core machine"},
                "gpu": {"side": "gpu", "rows_per_s": 40000.0, "usd_per_hour": 4.1, "usd_per_1k_rows": 2.8e-5,
                        "measured": "one H200"}}
    evaluation = {"side": "cpu", "partition": "cpu", "gpus_per_node": 0, "reason": "evaluation: -> cpu partition",
                  "cpu_s": 0.1, "max_cpu_s": 30.0, "parameter_rows": 5e9}
    figures = placement_figures(training, evaluation)
    assert (figures["side"], figures["partition"], figures["gpus_per_node"]) == ("cpu", "cpu", 0)
    assert figures["cpu"] == {"rows_per_s": 80000.0, "usd_per_1k_rows": 3.5e-7, "measured": "2-core machine"}
    assert figures["evaluation"]["partition"] == "cpu" and "parameter_rows" not in figures["evaluation"]
    assert placement_figures(None, evaluation) is None
    assert placement_figures(training, None)["evaluation"] is None


@pytest.mark.parametrize("records, text", [
    (None, None),
    ([], "none"),
    ([{"kind": "stall", "job_id": "7", "stall": {"ranks": [{"rank": 1, "node": "gpu-node-02"}]}}],
     "stall of rank 1@gpu-node-02 -> requeued"),
    ([{"kind": "exclude_node", "node": "gpu-node-01", "check": "scratch"}, {"kind": "requeue", "class": "preempted"}],
     "node gpu-node-01 failed its self-check (scratch) -> excluded; preempted -> requeued"),
])
def test_the_report_says_what_healed_the_training_job(records, text):
    assert training_figures({"job_id": "7", "recovery": records}, None)["healing"] == text


@pytest.mark.parametrize(("forced", "nodes", "stage", "why"), [
    (None, 1, 0, "ZeRO stage 0: one node (nightly.zero_stage_one_node)"),
    (None, 2, 1, "ZeRO stage 1: 2 nodes (nightly.zero_stage_several_nodes)"),
    (None, 16, 1, "ZeRO stage 1: 16 nodes (nightly.zero_stage_several_nodes)"),
    (2, 1, 2, "ZeRO stage 2: nightly.zero_stage forces it"),
    (0, 8, 0, "ZeRO stage 0: nightly.zero_stage forces it"),
])
def test_the_zero_stage_follows_the_topology_unless_forced(forced, nodes, stage, why):
    assert zero_stage_for(forced, nodes, one_node=0, several_nodes=1) == (stage, why)


@pytest.mark.parametrize(("deepspeed", "text"), [
    ({"zero_stage": 0, "precision": "bf16", "dtype": "float32", "device": "cuda", "fused_optimizer": True,
      "gradient_clipping_by": "loop"}, "ZeRO 0, bf16 (float32 weights) on cuda, fused AdamW, clipping by loop"),
    ({"zero_stage": 1, "requested_precision": "auto", "device": "cpu"}, "ZeRO 1, auto on cpu, AdamW"),
    ({}, None), ({"precision": "fp32"}, None),
])
def test_the_report_says_what_the_job_chose(deepspeed, text):
    assert strategy_text(deepspeed) == text
