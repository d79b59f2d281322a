"""The oncall_training_job DAG on the real local Slurm over SSH: cancel and requeue a job of ours, verified
from Slurm's own state, and refusals for unknown, foreign and finished jobs."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from helpers.dag_runs import run_captured
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.utils.slurm import SlurmJobSpec, deterministic_job_name, render_sbatch_script

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "oncall_training_job"
SOURCE = (REPO / "dags" / f"{DAG_ID}.py").read_text()


@pytest.fixture
def submit_job(slurm, stack):
    """sbatch a job on the cpu partition; every job submitted is cancelled and its logs removed afterwards."""
    log_dir = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/tests-oncall-{uuid.uuid4().hex[:8]}"
    slurm.run(["mkdir", "-p", "--", log_dir])
    submitted: list[str] = []

    def submit(name: str, command: list[str], requeue: bool = True) -> str:
        spec = SlurmJobSpec(job_name=name, partition="cpu", command=command, time_limit=10, requeue=requeue,
                            output=f"{log_dir}/%x-%j.out")
        submitted.append(slurm.submit(render_sbatch_script(spec)))
        return submitted[-1]

    yield submit
    for job_id in submitted:
        slurm.run(["scancel", job_id])
    slurm.run(["rm", "-rf", "--", log_dir])


def ours() -> str:
    return deterministic_job_name("nightly_training", "training.train", f"manual__{uuid.uuid4().hex}")


def wait_for(hook: SlurmHook, job_id: str, states: tuple[str, ...], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    status = hook.status(job_id)
    while status.state not in states and time.monotonic() < deadline:
        time.sleep(0.5)
        status = hook.status(job_id)
    assert status.state in states, status
    return status


def conf(job_id: str, action: str, reason: str = "integration test: the job hangs") -> dict:
    return {"job_id": job_id, "action": action, "reason": reason}


@pytest.fixture
def training_run(stack):
    """An MLflow run in the nightly experiment tagged with a job name, as the training operator leaves one."""
    from hybridflow.hooks.mlflow import MlflowHook
    from hybridflow.utils.mlflow_tracking import job_name_tags

    mlflow, made = MlflowHook(), []

    def make(job_name: str) -> str:
        run = mlflow.create_run(mlflow.experiment_id("nightly_training"), "tests-oncall", job_name_tags(job_name),
                                int(time.time() * 1000))
        made.append(run["info"]["run_id"])
        return made[-1]

    yield make
    for run_id in made:  # out of the nightly history the report charts
        mlflow.call("POST", "runs/delete", payload={"run_id": run_id})


def test_oncall_cancel_ends_our_running_job_cancelled(run_dag, slurm, submit_job, training_run):
    from hybridflow.hooks.mlflow import MlflowHook
    from hybridflow.utils.mlflow_tracking import ONCALL_TAG

    name = ours()
    job_id = submit_job(name, ["sleep", "600"])
    run_id = training_run(name)
    wait_for(slurm, job_id, ("RUNNING",))
    result = run_dag(SOURCE, DAG_ID, conf(job_id, "cancel", "holds a node at 0% utilisation"))
    assert result["state"] == "success", result["log"][-4000:]
    outcome = result["tasks"]["apply_action"]["xcom"]["return_value"]
    assert outcome["before"]["state"] == "RUNNING" and outcome["after"]["state"] == "CANCELLED"
    assert (outcome["job_id"], outcome["action"]) == (job_id, "cancel")
    assert outcome["reason"] == "holds a node at 0% utilisation"
    assert slurm.status(job_id).state == "CANCELLED"
    assert "reason: 'holds a node at 0% utilisation'" in result["log"]
    # The job's training run says what on-call did and why.
    assert result["tasks"]["record_in_mlflow"]["xcom"]["return_value"] == f"recorded on MLflow run {run_id}"
    tags = {t["key"]: t["value"] for t in MlflowHook().get_run(run_id)["data"]["tags"]}
    assert f"cancel of Slurm job {job_id} by " in tags[ONCALL_TAG]
    assert tags[ONCALL_TAG].endswith(": RUNNING -> CANCELLED; reason: holds a node at 0% utilisation")


def test_oncall_requeue_puts_our_running_job_back_with_a_higher_restart_count(run_dag, slurm, submit_job):
    job_id = submit_job(ours(), ["sleep", "600"])
    before = wait_for(slurm, job_id, ("RUNNING",))
    result = run_dag(SOURCE, DAG_ID, conf(job_id, "requeue", "node looks sick"))
    assert result["state"] == "success", result["log"][-4000:]
    outcome = result["tasks"]["apply_action"]["xcom"]["return_value"]
    assert outcome["before"]["state"] == "RUNNING" and outcome["before"]["restarts"] == before.restarts
    assert outcome["after"]["restarts"] == before.restarts + 1
    assert outcome["after"]["state"] in ("PENDING", "REQUEUED", "CONFIGURING", "RUNNING")
    assert slurm.status(job_id).restarts == before.restarts + 1
    recorded = result["tasks"]["record_in_mlflow"]["xcom"]["return_value"]  # a job no training run names
    assert recorded.startswith("no MLflow run of experiment 'nightly_training' belongs to Slurm job"), recorded


def test_oncall_unknown_job_id_fails_clearly_without_retries(run_dag):
    result = run_dag(SOURCE, DAG_ID, conf("987654321", "cancel"))
    assert result["state"] == "failed"
    assert result["tasks"]["look_up_job"]["state"] == "failed"
    assert result["tasks"]["look_up_job"]["try_number"] == 1  # a refusal is not retried
    assert result["tasks"]["apply_action"]["state"] == "upstream_failed"
    assert "cancel refused: Slurm on mlops@127.0.0.1:2222 knows no job 987654321" in result["log"]


def test_oncall_refuses_a_job_that_is_not_ours_and_leaves_it_running(run_dag, slurm, submit_job):
    job_id = submit_job("someone-elses-experiment", ["sleep", "600"])
    wait_for(slurm, job_id, ("RUNNING",))
    result = run_dag(SOURCE, DAG_ID, conf(job_id, "cancel"))
    assert result["state"] == "failed"
    assert result["tasks"]["apply_action"]["state"] == "upstream_failed"
    assert (f"cancel refused: Slurm job {job_id} ('someone-elses-experiment', RUNNING, restarts 0) is not "
            "one of ours: its name does not start with 'hf-'") in result["log"]
    assert slurm.status(job_id).state == "RUNNING"


def test_oncall_refuses_a_job_that_has_already_finished(run_dag, slurm, submit_job):
    job_id = submit_job(ours(), ["true"], requeue=False)
    wait_for(slurm, job_id, ("COMPLETED",))
    result = run_dag(SOURCE, DAG_ID, conf(job_id, "requeue"))
    assert result["state"] == "failed"
    assert "COMPLETED, restarts 0) has already finished; nothing to requeue" in result["log"]


@pytest.mark.parametrize("job_id", ["1; scancel -u mlops", "$(id)"])
def test_oncall_job_id_that_is_not_a_slurm_id_is_refused_by_the_trigger_form(isolated_airflow_env, job_id):
    out = run_captured(isolated_airflow_env, SOURCE, DAG_ID, conf(job_id, "cancel"))
    assert out.returncode != 0 and "RESULT " not in out.stdout
    assert "does not match" in out.stderr and "param job_id" in out.stderr
