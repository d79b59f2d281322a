"""Training that heals itself, on the real two-node Slurm through Airflow's task lifecycle (dag.test: the trigger
runs inline): a stopped rank is found by the stall watch, its stack reaches the job's log and on-call, and the
same job resumes from its checkpoint and completes; a node that fails its self-check is left out, and a node that
dies mid-training is left behind, and training completes on the other node; a data error fails at once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from helpers.processes import rank_pids
from helpers.stack import LOCALSTACK
from helpers.waiting import joined, run_in_thread, wait_until
from hybridflow.config import load_pipeline_config
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.notifiers.oncall import default_alerts_file
from hybridflow.utils.failures import parse_recovery_log, recovery_log_path
from hybridflow.utils.stalls import COLLECTIVE_MARGIN_S

pytestmark = pytest.mark.slow

# The bounds, with the default config's stall watch: the stall seen within 60 s of the rank stopping, the
# run succeeding within 2 minutes of it, not counting the wait for Slurm's scheduler to start the requeued job
# (its backfill pass, every 30 s by default: measured 11-28 s here; a cluster setting, not the pipeline's).
DETECTION_BOUND_S = 60
SUCCESS_BOUND_S = 120

TRAINING_DAG = textwrap.dedent('''
    from datetime import datetime, timedelta
    from airflow.sdk import DAG
    from hybridflow.operators.training import DeepSpeedTrainingOperator

    with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        DeepSpeedTrainingOperator(
            task_id="train", run_config={run_config!r}, run_dir={run_dir!r}, python={python!r},
            jobs_dir={jobs_dir!r}, partition="gpu-training", nodes={nodes}, gpus_per_node=1, cpus_per_task=1,
            time_limit=10, poll_interval_s=2, {stall}max_stall_restarts=1,
            mlflow_conn_id=None, retries={retries}, retry_delay=timedelta(seconds=1),
        )
''')


def alerts_of(dag_id: str) -> list[dict]:
    path = default_alerts_file()
    lines = path.read_text().splitlines() if path.exists() else []
    return [alert for alert in map(json.loads, lines) if alert["dag_id"] == dag_id]


def stop_while_training(hook: SlurmHook, run_dir: str, pid: int, warm_up_steps: int) -> tuple[float, dict]:
    """SIGSTOP the rank at a moment its heartbeat file (what the watch reads; the thread stops with the process)
    says it trains past its warm-up, so the deadline from its step time is the one under test; a stop that
    landed in a checkpoint is taken back. Returns when it stopped and its last heartbeat."""
    for _ in range(10):
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(0.5)  # a write of the file under way ends
        beat = json.loads(hook.read_text(f"{run_dir}/heartbeats/rank1.json") or "{}")
        if beat.get("phase") == "training" and beat.get("steps_timed", 0) > warm_up_steps:
            return stopped_at, beat
        os.kill(pid, signal.SIGCONT)
        time.sleep(2)
    pytest.fail(f"rank 1 was never seen training past its warm-up: {beat}")


def scheduler_wait_s(hook: SlurmHook, job_id: str) -> float:
    """Seconds from the requeued job's eligibility to its start (Slurm's accounting, one row per attempt)."""
    last = hook.run(["sacct", "-D", "-X", "-P", "-n", "-j", job_id, "--format=Eligible,Start"]).stdout.split()[-1]
    eligible, started = (datetime.fromisoformat(value) for value in last.split("|"))
    return (started - eligible).total_seconds()


def test_a_stopped_rank_is_found_within_a_minute_by_the_default_watch_named_and_the_job_resumes(
        run_dag, stack, training_area, make_run_config):
    """SIGSTOP rank 1 (on gpu-node-02) while it trains, past its first checkpoint, with the default config's stall
    watch (pipeline.yaml recovery, heartbeats every 5 s): within 60 s the task's log names rank 1, its node, its last
    step, its deadline from its median step time and its Python frames, as do the job's log and an on-call alert;
    the job, whose collective timeout was set above the watch, is requeued (one job id, restart 1), resumes from
    its checkpoint and completes; the task succeeds within 2 minutes of the stop."""
    features, run_dir = training_area
    dag_id = f"heal_stall_{uuid.uuid4().hex[:6]}"
    recovery = load_pipeline_config().recovery
    config = make_run_config(features, max_steps=600, checkpoint_every_steps=300)
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall="", nodes=2, retries=0)
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
        stopped_at, beat = stop_while_training(hook, run_dir, stopped_pid, recovery.stall_warm_up_steps)

        result = joined(thread, box, 540)
        succeeded_s = time.time() - stopped_at
        assert result["state"] == "success", result["log"][-5000:]
        event = result["tasks"]["train"]["xcom"]["return_value"]
        assert event["job_id"] == job_id and event["restarts"] == 1, event  # one job chain, requeued once
        job_config = json.loads(hook.read_text(f"{run_dir}/config.json"))
        assert job_config["collective_timeout_s"] == recovery.stall_timeout_s + COLLECTIVE_MARGIN_S
        [stall] = [r for r in event["recovery"] if r["kind"] == "stall"]
        [rank] = stall["stall"]["ranks"]
        assert (rank["rank"], rank["node"], rank["pid"], rank["step"]) == (1, "gpu-node-02", stopped_pid, beat["step"])
        assert re.search(r"stall_factor=10 x median step [0-9.e-]+ s over \d+ steps", rank["deadline"]), rank
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert metrics["resumed_from_step"] >= progress["last_checkpoint_step"] and metrics["restarts"] == 1
        assert metrics["step"] == 600

        log = result["log"]  # the task's log, as on-call reads it
        named = f"rank 1@gpu-node-02 (pid {stopped_pid}, step {beat['step']} at its last heartbeat, training; "
        assert f"STALL of Slurm job {job_id}: no rank progressed for " in log and named in log, log[-5000:]
        assert "its heartbeat is silent too" in log and "Python stack of rank 1@gpu-node-02" in log
        assert "(hybridtrain/runner.py:" in log  # the job's own line, beside the collective it sits in
        assert "ranks (rank@node): 0@gpu-node-01, 1@gpu-node-02" in log and " rows/s" in log
        assert "Training finished: holdout AUC 0." in log
        completed = log[log.index("COMPLETED in"):]
        assert "finished at step 600" in completed and "real_accelerator" not in completed

        [alert] = [a for a in alerts_of(dag_id) if a["kind"] == "stall"]
        assert "rank 1@gpu-node-02" in alert["error"] and alert["job_id"] == job_id, alert
        assert "Python stack of rank 1@gpu-node-02" in alert["log_tail"]
        assert "(hybridtrain/runner.py:" in alert["log_tail"]
        job_log = hook.read_text(f"{run_dir}/logs/{event['name']}-{job_id}.err") or ""
        assert "STALL of Slurm job" in job_log and named in job_log and "(hybridtrain/runner.py:" in job_log
        assert "a collective operation failed" not in job_log  # the watch named the rank before gloo gave up
        records = parse_recovery_log(hook.read_text(recovery_log_path(f"{run_dir}/logs", event["name"])))
        assert [r["kind"] for r in records] == ["stall"]
        detected_s = records[0]["detected_at"] - stopped_at
        waited_s = scheduler_wait_s(hook, job_id)
        print(f"RELIABILITY stall job={job_id} step={beat['step']} detected_s={detected_s:.1f} "
              f"succeeded_s={succeeded_s:.1f} slurm_scheduler_wait_s={waited_s:.0f} deadline={rank['deadline']!r}")
        assert detected_s <= DETECTION_BOUND_S, detected_s
        assert succeeded_s - waited_s <= SUCCESS_BOUND_S, (succeeded_s, waited_s)
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
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall="", nodes=1, retries=0)
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
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], stall="", nodes=1, retries=1)
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
    # the stall watch kept out of the way: Slurm's own handling of a dead node is under test
    source = TRAINING_DAG.format(dag_id=dag_id, run_config=config, run_dir=run_dir,
                                 python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
                                 jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"],
                                 stall="stall_timeout_s=300, stall_floor_s=300, ", nodes=1, retries=0)
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
