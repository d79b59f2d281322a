"""What a training task records in MLflow, as pure functions: the run's identity, params, tags and figures."""

from __future__ import annotations

import json
import math

import pytest
from hybridflow.utils.mlflow_tracking import (
    RUN_KEY_TAG,
    TrainingRunIdentity,
    final_metrics,
    finish_tags,
    nightly_history,
    records_to_log,
    start_tags,
    stored_run_id,
    training_params,
    validate_experiment_name,
)

RUN_ID = "0123456789abcdef0123456789abcdef"


def test_one_identity_per_task_and_generation_whatever_the_run_id_holds():
    first = TrainingRunIdentity("nightly_training", "training.train", "manual__2026-12-04T22:08:57+00:00", 0)
    again = TrainingRunIdentity("nightly_training", "training.train", "manual__2026-12-04T22:08:57+00:00", 0)
    retrain = TrainingRunIdentity("nightly_training", "training.train", "manual__2026-12-04T22:08:57+00:00", 1)
    hostile = TrainingRunIdentity("nightly_training", "training.train", "x' OR tags.a = 'b", 0)
    assert first.key_sha == again.key_sha != retrain.key_sha
    assert retrain.first_generation() == first
    assert all(len(i.key_sha) == 32 and i.key_sha.isalnum() for i in (first, retrain, hostile))
    assert retrain.run_name.endswith("-retrain-1") and not first.run_name.endswith("-retrain-0")


@pytest.mark.parametrize("name", ["nightly_training", "team/propensity nightly", "é-ü 模型", "x" * 500,
                                  "'; DROP TABLE experiments; --"])
def test_experiment_names_are_stored_verbatim(name):
    assert validate_experiment_name(name, "nightly.mlflow_experiment") == name


@pytest.mark.parametrize("name", ["", "   ", None, 3, "x" * 501, "bad\nname", "tab\there", "nul\x00"])
def test_unusable_experiment_names_are_refused_naming_the_field(name):
    with pytest.raises(ValueError, match="nightly.mlflow_experiment"):
        validate_experiment_name(name, "nightly.mlflow_experiment")


@pytest.mark.parametrize("text, expected", [
    (json.dumps({"run_id": RUN_ID}), RUN_ID),
    (None, None), ("", None), ("not json", None), ("[]", None),
    (json.dumps({"run_id": "../../etc"}), None), (json.dumps({"run_id": 5}), None),
])
def test_the_stored_run_id_is_used_only_when_it_is_an_mlflow_run_id(text, expected):
    assert stored_run_id(text) == expected


def test_start_tags_carry_the_task_identity_and_the_search_key():
    identity = TrainingRunIdentity("d", "t", "r", 2)
    tags = start_tags(identity, try_number=3, ds="2025-06-03")
    assert tags[RUN_KEY_TAG] == identity.key_sha
    assert (tags["hybridflow.dag_id"], tags["hybridflow.task_id"], tags["hybridflow.airflow_run_id"]) == ("d", "t", "r")
    assert (tags["hybridflow.retrain_generation"], tags["hybridflow.try_number"], tags["hybridflow.ds"]) == (
        "2", "3", "2025-06-03")


def test_params_come_from_the_run_config_and_the_job_shape_only():
    run_config = {"model": {"preset": "small"}, "ds": ["2025-06-03", "2025-06-01", "2025-06-02"], "batch_size": 128,
                  "learning_rate": 0.01, "epochs": 5, "max_steps": None, "zero_stage": 1, "seed": 42}
    params = training_params(run_config, nodes=2, gpus_per_node=2, ranks_per_node=2)
    assert params["model_preset"] == "small" and params["world_size"] == "4" and params["nodes"] == "2"
    assert json.loads(params["data_window"]) == {"start": "2025-06-01", "end": "2025-06-03"}
    assert params["data_days"] == "3" and "max_steps" not in params and params["precision"] == "auto"
    assert all(isinstance(value, str) for value in params.values())
    ranged = training_params({"ds_range": {"start": "a", "end": "b"}, "model": "custom"}, nodes=1, gpus_per_node=0,
                             ranks_per_node=2)
    assert json.loads(ranged["data_window"]) == {"start": "a", "end": "b"} and ranged["model_preset"] == "custom"


def test_final_metrics_keep_the_figures_that_exist():
    metrics = {"holdout": {"auc": 0.71, "log_loss": 0.48}, "samples_per_s": 1234.5, "train_wall_time_s": 12,
               "restarts": 0, "allreduce": {"share": None}, "mean_gpu_utilization_pct": None,
               "train_rows_processed": math.nan}
    assert final_metrics(metrics, gpu_hours=0.01) == {
        "final_holdout_auc": 0.71, "final_holdout_log_loss": 0.48, "train_rows_per_s": 1234.5,
        "train_wall_time_s": 12.0, "restarts": 0.0, "gpu_hours": 0.01}
    assert final_metrics({}) == {}


def test_final_metrics_carry_the_job_efficiency_that_slurm_measured():
    efficiency = {"queue_wait_s": 1.0, "time_limit_share": 0.05, "cpu_efficiency": None, "max_rss_gib": 0.5,
                  "gpu_hours_allocated": 0.0111, "lost_to_requeues_s": 0, "not_measured": {"cpu_efficiency": "why"}}
    assert final_metrics({}, efficiency=efficiency) == {
        "slurm_queue_wait_s": 1.0, "slurm_time_limit_share": 0.05, "slurm_max_rss_gib": 0.5,
        "slurm_gpu_hours_allocated": 0.0111, "slurm_lost_to_requeues_s": 0.0}


def test_finish_tags_name_the_job_its_nodes_code_and_data():
    ranks = [{"rank": 0, "node": "gpu-node-02"}, {"rank": 1, "node": "gpu-node-01"}, {"rank": 2, "node": "gpu-node-01"}]
    metrics = {"deepspeed": {"nodes": 2, "ranks": ranks, "precision": "fp32", "device": "cpu"},
               "code_version": "abc", "data": {"sha256": "f00"}}
    tags = finish_tags(metrics, slurm_job_id="168", partition="gpu-training")
    assert tags == {"hybridflow.slurm_job_id": "168", "hybridflow.partition": "gpu-training",
                    "hybridflow.nodes": "gpu-node-01,gpu-node-02", "hybridflow.code_version": "abc",
                    "hybridflow.features_sha256": "f00", "hybridflow.precision": "fp32", "hybridflow.device": "cpu"}


@pytest.mark.parametrize(("logged", "expected"), [
    ({"loss": {10, 20}}, [30]),  # live up to 20
    ({}, [10, 20, 30]),  # nothing went live
    ({"loss": set()}, [10, 20, 30]),
    ({"loss": {10, 30}}, [20]),  # 20 written, then the job was killed before sending it; the resumed job sent 30
    ({"loss": {10, 20, 30}}, []),  # a retry after everything was logged adds nothing
    ({"auc": {10, 20, 30}}, [10, 20, 30]),  # another metric's steps do not count
])
def test_after_the_job_exactly_the_points_the_run_lacks_are_logged(logged, expected):
    records = [{"key": "loss", "step": s, "value": 1.0, "timestamp": 1} for s in (10, 20, 30)]
    assert [r["step"] for r in records_to_log(records, logged)] == expected


def mlflow_run(ds, status="FINISHED", end=1, auc=0.8, rows=1000.0, train_s=10.0, run_id="r"):
    metrics = [{"key": k, "value": v} for k, v in (("final_holdout_auc", auc), ("train_rows_processed", rows),
                                                   ("train_wall_time_s", train_s)) if v is not None]
    return {"info": {"status": status, "end_time": end, "run_id": run_id},
            "data": {"tags": [{"key": "hybridflow.ds", "value": ds}] if ds is not None else [], "metrics": metrics}}


@pytest.mark.parametrize(("runs", "expected"), [
    ([mlflow_run("2026-01-02"), mlflow_run("2026-01-01")], ["2026-01-01", "2026-01-02"]),  # by ds
    ([mlflow_run("2026-01-01", status="FAILED"), mlflow_run("2026-01-02")], ["2026-01-02"]),  # finished only
    ([mlflow_run(None), mlflow_run("01/02/2026"), mlflow_run("2026-01-01\n")], []),  # no ds, not a ds
    ([], []),
], ids=["ordered", "finished-only", "bad-ds", "none"])
def test_nightly_history_is_one_finished_run_per_data_day(runs, expected):
    assert [night["ds"] for night in nightly_history(runs)] == expected


def test_nightly_history_keeps_the_last_run_of_a_day_and_the_last_30_days():
    runs = [mlflow_run("2026-01-01", end=5, auc=0.7, run_id="late"), mlflow_run("2026-01-01", end=1, run_id="early")]
    (night,) = nightly_history(runs)
    assert night == {"ds": "2026-01-01", "auc": 0.7, "rows": 1000.0, "train_s": 10.0, "run_id": "late"}
    days = [mlflow_run(f"2026-01-{day:02d}") for day in range(1, 32)] + [mlflow_run("2026-02-01", auc=None)]
    history = nightly_history(days)
    assert len(history) == 30 and history[0]["ds"] == "2026-01-03" and history[-1] == {
        "ds": "2026-02-01", "auc": None, "rows": 1000.0, "train_s": 10.0, "run_id": "r"}
