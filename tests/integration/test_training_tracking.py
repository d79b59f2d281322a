"""A training task is one MLflow run on the stack's real tracking server (PostgreSQL backend, artifacts proxied to
S3): rank 0 logs live while the Slurm job runs, the task logs what is missing afterwards, a killed task and a
requeued job continue the same run, nodes that cannot reach the server lose nothing, and the credentials stay in
one 0600 file that is gone once the task is done."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from helpers.mlflow_server import Mlflow
from hybridflow.hooks.slurm import SlurmHook

LOGICAL_DATE = "2026-01-01T00:00:00+00:00"


@pytest.fixture
def mlflow(stack) -> Mlflow:
    return Mlflow(stack)


def training_dag(dag_id: str, run_config: dict, run_dir: str, stack, experiment: str, conn_id: str = "mlflow_default",
                 **operator) -> str:
    extra = "".join(f", {key}={value!r}" for key, value in operator.items())
    return textwrap.dedent(f'''
        from datetime import datetime
        from airflow.sdk import DAG
        from hybridflow.operators.training import DeepSpeedTrainingOperator
        with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
            DeepSpeedTrainingOperator(
                task_id="train", run_config={run_config!r}, run_dir="{run_dir}",
                python="{stack["HYBRIDFLOW_CLUSTER_PYTHON"]}", jobs_dir="{stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"]}",
                partition="gpu-training", gpus_per_node=1, cpus_per_task=2, time_limit=10, poll_interval_s=2,
                retries=0, mlflow_conn_id="{conn_id}", mlflow_experiment="{experiment}"{extra},
            )
    ''')


def step_lines(run_dir: str) -> list[dict]:
    text = SlurmHook().read_text(f"{run_dir}/step_metrics.jsonl") or ""
    return [json.loads(line) for line in text.splitlines()]


def job_texts(run_dir: str, job_id: str) -> dict[str, str]:
    """Everything Slurm and the job show of the job: batch script, scontrol, its logs and run files."""
    hook = SlurmHook()
    texts = {
        "batch script": hook.run(["scontrol", "write", "batch_script", job_id, "-"]).stdout,
        "scontrol show job": hook.run(["scontrol", "show", "job", "-dd", job_id]).stdout,
        "sacct": hook.run(["sacct", "-j", job_id, "-P", "--format=JobName,Comment,WorkDir,SubmitLine"]).stdout,
    }
    for name in hook.run(["ls", "--", f"{run_dir}/logs"]).stdout.split():
        texts[f"logs/{name}"] = hook.read_text(f"{run_dir}/logs/{name}") or ""
    for name in ("config.json", "metrics.json", "progress.json", "mlflow_run.json"):
        texts[name] = hook.read_text(f"{run_dir}/{name}") or ""
    return texts


def test_a_training_task_is_one_mlflow_run_that_grows_live_survives_a_kill_and_a_requeue_and_keeps_its_secret(
        run_dag, training_area, stack, make_run_config, mlflow, jobs_named, task_watch, tmp_path):
    """One expensive run for all of item 3-5's promises: the loss curve grows in MLflow while the job trains; the
    task process is then killed while it waits and the job is requeued while it trains; the rerun of the task
    reattaches to the job and finishes the same MLflow run, with each step once, params, tags, final figures
    and the model; the password is in no Slurm record, job log, run file or task log."""
    features, run_dir = training_area
    dag_id = f"t_track_{uuid.uuid4().hex[:6]}"
    experiment = f"test-tracking-{uuid.uuid4().hex[:6]}"
    # long enough (about 20 s of steps here) that live flushes (every 5 s) land before the faults and the end
    config = make_run_config(features, max_steps=6000, batch_size=256, model={"preset": "small"},
                             checkpoint_every_steps=500, log_every_steps=50)
    source = training_dag(dag_id, config, run_dir, stack, experiment)
    first_log = tmp_path / "first-try.log"
    first = run_dag(source, dag_id, logical_date=LOGICAL_DATE, background=True, output=first_log)
    hook = SlurmHook()
    live: list[dict] = []
    try:
        task_watch.wait(dag_id, "deferred", task_id="train", timeout_s=120)
        (job_id,) = jobs_named(f"hf-{dag_id}-train-")
        credentials = hook.run(["stat", "-c", "%a %U", "--", f"{run_dir}/.mlflow-credentials.json"]).stdout.strip()
        deadline = time.monotonic() + 240
        progress: dict = {}
        while time.monotonic() < deadline and not (live and (progress.get("last_checkpoint_step") or 0) >= 500):
            time.sleep(1)
            progress = json.loads(hook.read_text(f"{run_dir}/progress.json") or "{}")
            runs = mlflow.runs(experiment)
            live = mlflow.history(runs[0]["info"]["run_id"], "loss") if runs else []
        assert progress.get("state") != "completed", f"the job finished before the faults: {progress}"
        assert hook.read_text(f"{run_dir}/metrics.json") is None
        assert live, f"no loss point reached MLflow while the job trained (progress {progress})"
        assert credentials == "600 mlops"  # only the job user reads it, while the job runs
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    (before,) = mlflow.runs(experiment)
    assert before["info"]["status"] == "RUNNING"
    assert hook.run(["scontrol", "requeue", job_id]).returncode == 0

    result = run_dag(source, dag_id, logical_date=LOGICAL_DATE)
    assert result["state"] == "success", result["log"][-4000:]
    returned = result["tasks"]["train"]["xcom"]["return_value"]
    assert returned["job_id"] == job_id and returned["metrics"]["restarts"] == 1
    assert jobs_named(f"hf-{dag_id}-train-") == [job_id]

    (run,) = mlflow.runs(experiment)  # exactly one run for the task, through the kill and the requeue
    info, data = run["info"], run["data"]
    assert info["run_id"] == before["info"]["run_id"] == returned["mlflow"]["run_id"]
    assert info["status"] == "FINISHED" and returned["mlflow"]["url"].endswith(f"/runs/{info['run_id']}")
    assert result["tasks"]["train"]["xcom"]["mlflow_run_url"] == returned["mlflow"]["url"]  # the "MLflow run" link
    params = {p["key"]: p["value"] for p in data["params"]}
    assert params | {"model_preset": "small", "batch_size": "256", "zero_stage": "1", "nodes": "1",
                     "gpus_per_node": "1", "max_steps": "6000", "learning_rate": "0.02"} == params
    assert json.loads(params["data_window"]) == config["ds_range"]
    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert tags["hybridflow.dag_id"] == dag_id and tags["hybridflow.task_id"] == "train"
    assert tags["hybridflow.slurm_job_id"] == job_id and tags["hybridflow.retrain_generation"] == "0"
    assert tags["hybridflow.try_number"] == "1"  # the try that created the run
    assert len(tags["hybridflow.code_version"]) == 16 and len(tags["hybridflow.features_sha256"]) == 64
    assert tags["hybridflow.nodes"] in ("gpu-node-01", "gpu-node-02")
    final = {m["key"]: m["value"] for m in data["metrics"]}
    assert final["final_holdout_auc"] == pytest.approx(returned["metrics"]["auc"], abs=1e-6)
    assert final["restarts"] == 1

    # every step is in MLflow exactly once: live from either job incarnation, or by the task after the job
    loss = mlflow.history(info["run_id"], "loss")
    steps = [p["step"] for p in loss]
    assert sorted(steps) == list(range(50, 6001, 50)), "a step is missing or logged twice"
    assert {line["step"] for line in step_lines(run_dir) if "loss" in line} == set(steps)
    rates = mlflow.history(info["run_id"], "rows_per_s")
    assert len(rates) > len(loss) // 2 and min(p["value"] for p in rates) > 0
    assert mlflow.history(info["run_id"], "holdout_auc")[-1]["step"] == 6000

    artifacts = {**mlflow.artifacts(info["run_id"], "run"), **mlflow.artifacts(info["run_id"], "model")}
    assert set(artifacts) == {"run/config.json", "run/metrics.json", "model/model.pt", "model/signature.json",
                              "model/smoke.json"}
    assert artifacts["model/model.pt"] == Path(run_dir, "export", "model.pt").stat().st_size

    # the secret: in no Slurm record, job log, run file or task log of either try; its file is gone
    assert hook.read_text(f"{run_dir}/.mlflow-credentials.json") is None
    texts = job_texts(run_dir, job_id) | {"first try's log": first_log.read_text(), "rerun's log": result["log"]}
    assert json.loads(texts["config.json"])["tracking"]["run_id"] == info["run_id"]
    assert "logs to MLflow" in texts["first try's log"] or "MLflow run" in texts["first try's log"]
    leaked = [name for name, text in texts.items() if mlflow.password in text]
    assert not leaked, f"the MLflow password appears in {leaked}"
    assert any(name.startswith("logs/") for name in texts)


def test_nodes_that_cannot_reach_mlflow_train_on_and_the_task_logs_every_point_after_the_job(
        run_dag, training_area, stack, make_run_config, mlflow, isolated_airflow_env, monkeypatch):
    """As on an HPC cluster whose compute nodes have no route to the server: the connection names, for the
    nodes, a port where nothing listens."""
    features, run_dir = training_area
    conn = json.loads(stack["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    conn["extra"] = json.dumps({"tracking_uri_on_cluster": "http://127.0.0.1:9"})  # discard port: refused
    monkeypatch.setitem(isolated_airflow_env, "AIRFLOW_CONN_MLFLOW_CUT_OFF", json.dumps(conn))
    dag_id = f"t_track_cut_{uuid.uuid4().hex[:6]}"
    experiment = f"test-tracking-{uuid.uuid4().hex[:6]}"
    source = training_dag(dag_id, make_run_config(features, max_steps=200), run_dir, stack, experiment,
                          conn_id="mlflow_cut_off")
    result = run_dag(source, dag_id)
    assert result["state"] == "success", result["log"][-4000:]
    returned = result["tasks"]["train"]["xcom"]["return_value"]
    assert returned["metrics"]["step"] == 200

    logs = "".join(text for name, text in job_texts(run_dir, returned["job_id"]).items() if name.startswith("logs/"))
    assert logs.count("MLflow tracking unavailable") == 1, logs[-3000:]  # said once, not per step
    (run,) = mlflow.runs(experiment)
    lines = step_lines(run_dir)
    points = sum(len(line) - 2 for line in lines)  # every figure of every line (step and timestamp aside)
    assert returned["mlflow"]["logged_after_job"] == points > 0
    loss = mlflow.history(run["info"]["run_id"], "loss")
    assert [p["step"] for p in loss] == [line["step"] for line in lines if "loss" in line]
    assert run["info"]["status"] == "FINISHED"


def test_a_failed_job_ends_its_run_failed_and_the_retry_reopens_and_finishes_the_same_run(
        run_dag, training_area, stack, make_run_config, mlflow, tmp_path):
    """A job that fails (its features are missing: a data error, exit 2) marks the run FAILED with the job's end;
    the task's next try, with the data fixed, trains in the same run directory and finishes the same run."""
    features, run_dir = training_area
    dag_id = f"t_track_fail_{uuid.uuid4().hex[:6]}"
    experiment = f"test-tracking-{uuid.uuid4().hex[:6]}"
    empty = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "features" / f"test-empty-{uuid.uuid4().hex[:6]}"
    broken = make_run_config(features, max_steps=40) | {"features_root": str(empty)}
    failed = run_dag(training_dag(dag_id, broken, run_dir, stack, experiment), dag_id, logical_date=LOGICAL_DATE)
    assert failed["state"] == "failed", failed["log"][-3000:]
    (run,) = mlflow.runs(experiment)
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["status"] == "FAILED" and tags["hybridflow.job_end"].startswith("FAILED 2:")
    assert SlurmHook().read_text(f"{run_dir}/.mlflow-credentials.json") is None

    fixed = run_dag(training_dag(dag_id, make_run_config(features, max_steps=40), run_dir, stack, experiment),
                    dag_id, logical_date=LOGICAL_DATE)
    assert fixed["state"] == "success", fixed["log"][-3000:]
    (again,) = mlflow.runs(experiment)
    assert again["info"]["run_id"] == run["info"]["run_id"] and again["info"]["status"] == "FINISHED"
    tags = {t["key"]: t["value"] for t in again["data"]["tags"]}
    assert tags["hybridflow.slurm_job_id"] == fixed["tasks"]["train"]["xcom"]["slurm_job_id"]
    assert tags["hybridflow.job_end"] == "COMPLETED 0:0"
