"""'Train again' on purpose, on the real Slurm through Airflow's task lifecycle: rerunning a training task in the
same DAG run (same run id) follows its COMPLETED job and submits nothing; retrain=1 submits exactly one new job,
trains fresh in its own run directory and leaves generation 0's outputs as they were; generation 1's job is then
found by its own name, so rerunning it submits nothing either. In MLflow each generation is one run, the retrain's
linked to the first."""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest
from helpers.mlflow_server import Mlflow
from hybridflow.hooks.slurm import SlurmHook

LOGICAL_DATE = "2026-01-02T00:00:00+00:00"  # one date for every run: the same run id, what a cleared task sees


@pytest.fixture
def generation_dirs(training_area):
    """The test's run directory; generation 1's sibling is removed afterwards too."""
    features, run_dir = training_area
    yield features, run_dir
    hook = SlurmHook()
    hook.run(["rm", "-rf", "--", f"{run_dir}.retrain-1"])
    hook.close()


def test_retrain_generation_rerun_reattaches_and_retrain_submits_exactly_one_fresh_job(run_dag, jobs_named,
                                                                                      generation_dirs, stack,
                                                                                      make_run_config):
    features, run_dir = generation_dirs
    dag_id = f"t_retrain_{uuid.uuid4().hex[:6]}"
    experiment = f"test-retrain-{uuid.uuid4().hex[:6]}"
    source = textwrap.dedent(f'''
        from datetime import datetime
        from airflow.sdk import DAG, Param
        from hybridflow.operators.training import DeepSpeedTrainingOperator
        with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
                 params={{"retrain": Param(0, type="integer", minimum=0, maximum=1000)}}):
            DeepSpeedTrainingOperator(
                task_id="train", run_config={make_run_config(features, max_steps=40)!r}, run_dir="{run_dir}",
                python="{stack["HYBRIDFLOW_CLUSTER_PYTHON"]}", jobs_dir="{stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"]}",
                partition="gpu-training", gpus_per_node=1, cpus_per_task=2, time_limit=10, poll_interval_s=2,
                retries=0, retrain="{{{{ params.retrain }}}}", mlflow_experiment="{experiment}",
            )
    ''')
    ours = f"hf-{dag_id}-"
    hook = SlurmHook()

    first = run_dag(source, dag_id, logical_date=LOGICAL_DATE)
    assert first["state"] == "success", first["log"][-4000:]
    job_0 = first["tasks"]["train"]["xcom"]["slurm_job_id"]
    assert first["tasks"]["train"]["xcom"]["return_value"]["run_dir"] == run_dir
    assert jobs_named(ours) == [job_0]
    metrics_0 = hook.read_text(f"{run_dir}/metrics.json")
    checkpoints_0 = hook.run(["ls", f"{run_dir}/checkpoints"]).stdout

    # default: the rerun follows generation 0's COMPLETED job (never twice)
    rerun = run_dag(source, dag_id, logical_date=LOGICAL_DATE)
    assert rerun["state"] == "success", rerun["log"][-4000:]
    assert f"Reattaching to Slurm job {job_0}" in rerun["log"] and "Submitted Slurm job" not in rerun["log"]
    assert rerun["tasks"]["train"]["xcom"]["slurm_job_id"] == job_0
    assert jobs_named(ours) == [job_0]

    # retrain=1: exactly one new job, fresh, in its own run directory
    retrained = run_dag(source, dag_id, conf={"retrain": 1}, logical_date=LOGICAL_DATE)
    assert retrained["state"] == "success", retrained["log"][-4000:]
    assert retrained["run_id"] == first["run_id"]
    job_1 = retrained["tasks"]["train"]["xcom"]["slurm_job_id"]
    assert job_1 != job_0 and f"Submitted Slurm job {job_1}" in retrained["log"]
    assert jobs_named(ours) == [job_0, job_1]
    returned = retrained["tasks"]["train"]["xcom"]["return_value"]
    assert returned["state"] == "COMPLETED" and "train_retrain-1" in returned["name"]
    assert returned["retrain"] == 1 and returned["run_dir"] == f"{run_dir}.retrain-1"
    metrics_1 = json.loads(hook.read_text(f"{run_dir}.retrain-1/metrics.json"))
    assert metrics_1["resumed_from_step"] is None and metrics_1["step"] == 40  # trained from scratch
    assert json.loads(hook.read_text(f"{run_dir}.retrain-1/config.json"))["run_dir"] == f"{run_dir}.retrain-1"
    # generation 0's outputs stay as they were
    assert hook.read_text(f"{run_dir}/metrics.json") == metrics_0
    assert hook.run(["ls", f"{run_dir}/checkpoints"]).stdout == checkpoints_0
    assert hook.run(["test", "-s", f"{run_dir}/export/model.pt"]).returncode == 0

    # generation 1 is never twice either: what a rerun looks up before it would submit finds job_1
    from hybridflow.utils.slurm_jobs import job_to_reattach

    found = job_to_reattach(hook.find_by_name(returned["name"]), requeue_enabled=True)
    assert found is not None and found.job_id == job_1

    # MLflow: the rerun continued generation 0's run; the retrain is a second run, linked to the first
    runs = {run["info"]["run_id"]: run for run in Mlflow(stack).runs(experiment)}
    run_0 = first["tasks"]["train"]["xcom"]["return_value"]["mlflow"]["run_id"]
    assert rerun["tasks"]["train"]["xcom"]["return_value"]["mlflow"]["run_id"] == run_0
    run_1 = returned["mlflow"]["run_id"]
    assert set(runs) == {run_0, run_1} and run_1 != run_0
    tags = {t["key"]: t["value"] for t in runs[run_1]["data"]["tags"]}
    assert tags["hybridflow.retrain_of"] == run_0 and tags["hybridflow.retrain_generation"] == "1"
    assert all(run["info"]["status"] == "FINISHED" for run in runs.values())
    hook.close()
