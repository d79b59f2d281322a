"""Training that heals itself, on the real two-node Slurm through Airflow's task lifecycle (dag.test: the trigger
runs inline): a stopped rank is found by the stall watch, its stack reaches the job's log and on-call, and the
same job resumes from its checkpoint and completes; a node that fails its self-check is left out, and a node that
dies mid-training is left behind, and training completes on the other node; a data error fails at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from helpers.processes import rank_pids
from helpers.stack import LOCALSTACK
from helpers.waiting import joined, run_in_thread, wait_until
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.notifiers.oncall import default_alerts_file
from hybridflow.utils.failures import parse_recovery_log, recovery_log_path

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 20
# The bound: a stall is seen within stall_timeout_s + 30 s of the rank stopping.
DETECTION_SLACK_S = 30

TRAINING_DAG = textwrap.dedent('''
    from datetime import datetime, timedelta
    from airflow.sdk import DAG
    from hybridflow.operators.training import DeepSpeedTrainingOperator

    with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        DeepSpeedTrainingOperator(
            task_id="train", run_config={run_config!r}, run_dir={run_dir!r}, python={python!r},
            jobs_dir={jobs_dir!r}, partition="gpu-training", nodes={nodes}, gpus_per_node=1, cpus_per_task=1,
            time_limit=10, poll_interval_s=2, stall_timeout_s={stall_timeout_s}, max_stall_restarts=1,
            mlflow_conn_id=None, retries={retries}, retry_delay=timedelta(seconds=1),
        )
''')


def alerts_of(dag_id: str) -> list[dict]:
    path = default_alerts_file()
    lines = path.read_text().splitlines() if path.exists() else []
    return [alert for alert in map(json.loads, lines) if alert["dag_id"] == dag_id]


def test_a_stopped_rank_is_found_its_stack_reported_and_the_same_job_resumes_and_completes(
        run_dag, stack, training_area, make_run_config):
    """SIGSTOP rank 1 (on gpu-node-02) after the first checkpoint: within stall_timeout_s + 30 s the task names
    rank 1, its node and its Python frames in the job's log and an on-call alert; the job is requeued (one job
    id, restart 1), resumes from its checkpoint and completes; the task succeeds."""
    features, run_dir = training_area
    dag_id = f"heal_stall_{uuid.uuid4().hex[:6]}"
    config = make_run_config(features, max_steps=400, checkpoint_every_steps=20, heartbeat_every_s=1,
                             collective_timeout_s=600)
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"],
                                 stall_timeout_s=STALL_TIMEOUT_S, nodes=2, retries=0)
    hook = SlurmHook()
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=600)
    stopped_pid = None
    try:
        progress = wait_until("a first checkpoint", lambda: (p := json.loads(hook.read_text(
            f"{run_dir}/progress.json") or "{}")).get("last_checkpoint_step") and p, timeout_s=240)
        job_id = str(progress["slurm_job_id"])
        pids = rank_pids(job_id)
        assert sorted(pids) == [0, 1], pids
        stopped_pid = pids[1]
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped_at = time.time()

        result = joined(thread, box, 540)
        assert result["state"] == "success", result["log"][-5000:]
        event = result["tasks"]["train"]["xcom"]["return_value"]
        assert event["job_id"] == job_id and event["restarts"] == 1, event  # one job chain, requeued once
        [stall] = [r for r in event["recovery"] if r["kind"] == "stall"]
        assert [(r["rank"], r["node"]) for r in stall["stall"]["ranks"]] == [(1, "gpu-node-02")], stall
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert metrics["resumed_from_step"] >= progress["last_checkpoint_step"] and metrics["restarts"] == 1
        assert metrics["step"] == 400

        log = result["log"]  # the task's log, as on-call reads it
        assert "ranks (rank@node): 0@gpu-node-01, 1@gpu-node-02" in log and " rows/s" in log
        assert "Training finished: holdout AUC 0." in log
        completed = log[log.index("COMPLETED in"):]
        assert "finished at step 400" in completed and "real_accelerator" not in completed

        [alert] = [a for a in alerts_of(dag_id) if a["kind"] == "stall"]
        assert "rank 1@gpu-node-02" in alert["error"] and alert["job_id"] == job_id, alert
        assert "Python stack of rank 1@gpu-node-02" in alert["log_tail"]
        assert "(hybridtrain/runner.py:" in alert["log_tail"]  # the job's own line, beside the collective it sits in
        job_log = hook.read_text(f"{run_dir}/logs/{event['name']}-{job_id}.err") or ""
        assert "STALL of Slurm job" in job_log and "(hybridtrain/runner.py:" in job_log
        records = parse_recovery_log(hook.read_text(recovery_log_path(f"{run_dir}/logs", event["name"])))
        assert [r["kind"] for r in records] == ["stall"]
        detected_s = records[0]["detected_at"] - stopped_at
        assert detected_s <= STALL_TIMEOUT_S + DETECTION_SLACK_S, detected_s
    finally:
        if stopped_pid:
            try:
                os.kill(stopped_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        hook.close()


def test_a_node_that_fails_its_self_check_is_left_out_and_training_completes_on_the_other(
        run_dag, stack, training_area, make_run_config):
    """gpu-node-01's node-local scratch made unwritable: the first job (Slurm places a one-node job on gpu-node-01,
    the first idle node) ends with exit 79 before any rank starts; the task submits once more with
    --exclude=gpu-node-01, alerts on-call naming the node and the check, and training completes on gpu-node-02."""
    features, run_dir = training_area
    dag_id = f"heal_node_{uuid.uuid4().hex[:6]}"
    config = make_run_config(features, max_steps=40, checkpoint_every_steps=20)
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall_timeout_s=STALL_TIMEOUT_S,
                                 nodes=1, retries=0)
    scratch = Path(stack["HYBRIDFLOW_NODE_SCRATCH_DIR"].replace("%n", "gpu-node-01"))
    mode = scratch.stat().st_mode
    scratch.chmod(0o000)  # the job user can no longer write there: that node's self-check fails
    hook = SlurmHook()
    try:
        result = run_dag(source, dag_id, timeout_s=400)
        assert result["state"] == "success", result["log"][-5000:]
        event = result["tasks"]["train"]["xcom"]["return_value"]
        [excluded] = event["recovery"]
        assert (excluded["kind"], excluded["node"], excluded["check"]) == ("exclude_node", "gpu-node-01", "scratch")
        jobs = {status.job_id: status for status in hook.find_by_name(event["name"])}
        first = jobs[excluded["job_id"]]
        assert (first.state, first.exit_code) == ("FAILED", 79) and len(jobs) == 2, jobs
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert [(r["rank"], r["node"]) for r in metrics["deepspeed"]["ranks"]] == [(0, "gpu-node-02")]
        assert metrics["step"] == 40 and metrics["resumed_from_step"] in (None, 0)

        [alert] = [a for a in alerts_of(dag_id) if a["kind"] == "unhealthy_node"]
        assert "node gpu-node-01 failed its self-check (scratch:" in alert["error"], alert
        assert "NODE CHECK FAILED on gpu-node-01: scratch:" in alert["log_tail"]
    finally:
        scratch.chmod(mode)
        hook.close()


def test_a_data_error_fails_at_once_without_a_requeue_or_a_retry(run_dag, stack, training_area, make_run_config):
    """Features of days that were never published: the job exits 2 (FeatureDataError); the task names the class
    data_or_config_error and fails on its first try although it has a retry left; one job, never requeued."""
    features, run_dir = training_area
    dag_id = f"heal_data_{uuid.uuid4().hex[:6]}"
    config = make_run_config(features, ds_range={"start": "2025-01-01", "end": "2025-01-02"})
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall_timeout_s=STALL_TIMEOUT_S,
                                 nodes=1, retries=1)
    hook = SlurmHook()
    try:
        result = run_dag(source, dag_id, timeout_s=300)
        task = result["tasks"]["train"]
        assert (result["state"], task["state"], task["try_number"]) == ("failed", "failed", 1), result["log"][-3000:]
        log = result["log"]
        assert "failure class data_or_config_error (action fail; runbook include/runbooks/training.md#data-or-" \
               "config-error)" in log
        assert "the job's errors" in log and "2025-01-01" in log  # the job's own error leads the tail
        jobs = hook.find_by_name(next(line.split("(")[1].split(")")[0] for line in log.splitlines()
                                      if "ended FAILED with exit code 2:0" in line))
        assert [(j.state, j.exit_code, j.restarts) for j in jobs] == [("FAILED", 2, 0)]
    finally:
        hook.close()


def processes_of_job(job_id: str) -> list[int]:
    """Every process of a Slurm job on this machine: its slurmstepd daemons and what they run (the ranks, srun)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()) or f"SLURM_JOB_ID={job_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def node_states(hook: SlurmHook, node: str) -> set[str]:
    """The node's state in each partition it belongs to (sinfo prints one line per partition)."""
    return set(hook.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.split())


def test_a_node_that_dies_mid_training_is_left_behind_and_the_job_resumes_on_the_other(
        run_dag, stack, training_area, make_run_config):
    """gpu-node-01 'loses power' after the first checkpoint: its slurmd, the job's slurmstepd daemons and the rank
    are frozen, then killed (nothing on the node tells slurmctld anything). After SlurmdTimeout (30 s here) the node
    is DOWN and the job NODE_FAIL; Slurm requeues the same job, which resumes from its checkpoint on gpu-node-02
    and completes. Afterwards `localstack up` brings the node back."""
    features, run_dir = training_area
    dag_id = f"heal_nodefail_{uuid.uuid4().hex[:6]}"
    config = make_run_config(features, max_steps=3000, checkpoint_every_steps=300)
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall_timeout_s=300, nodes=1,
                                 retries=0)
    slurmd_pid = int(Path(f"{stack['HYBRIDFLOW_CLUSTER_DIR']}/slurm/run/slurmd-gpu-node-01.pid").read_text())
    hook = SlurmHook()
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=500)
    try:
        progress = wait_until("a first checkpoint", lambda: (p := json.loads(hook.read_text(
            f"{run_dir}/progress.json") or "{}")).get("last_checkpoint_step") and p, timeout_s=240, every_s=0.2)
        job_id = str(progress["slurm_job_id"])
        assert progress.get("ranks") == "0@gpu-node-01", progress
        victims = [slurmd_pid, *processes_of_job(job_id)]
        for pid in victims:  # frozen first, so none of them reports the others' end
            os.kill(pid, signal.SIGSTOP)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        died_at = time.monotonic()

        result = joined(thread, box, 480)
        assert result["state"] == "success", result["log"][-5000:]
        event = result["tasks"]["train"]["xcom"]["return_value"]
        assert event["job_id"] == job_id and event["restarts"] == 1, event  # the same job, requeued by Slurm
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert [(r["rank"], r["node"]) for r in metrics["deepspeed"]["ranks"]] == [(0, "gpu-node-02")]
        assert metrics["resumed_from_step"] >= progress["last_checkpoint_step"] and metrics["step"] == 3000
        attempts = hook.run(["sacct", "-D", "-X", "-P", "-n", "-j", job_id, "--format=State,NodeList"]).stdout
        assert attempts.split() == ["NODE_FAIL|gpu-node-01", "COMPLETED|gpu-node-02"], attempts
        print(f"RELIABILITY node-failure job={job_id} down_to_success_s={time.monotonic() - died_at:.0f}")
    finally:
        hook.close()
        subprocess.run([*LOCALSTACK, "up"], capture_output=True, timeout=300)  # slurmd of gpu-node-01 again
        checker = SlurmHook()
        in_service = {"idle", "mixed"}
        wait_until("gpu-node-01 back in service",
                   lambda: in_service >= node_states(checker, "gpu-node-01") != set(), timeout_s=120)
        checker.close()
