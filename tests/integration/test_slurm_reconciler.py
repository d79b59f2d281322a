"""The Slurm orphan reconciler (dags/slurm_reconciler.py) on the real local Slurm over SSH, through Airflow's real
task lifecycle: run_dag's Airflow home of its own holds the task instances the reconciler reads through the Task
SDK, so its verdicts depend on nothing else running on the stack. Each pass is scoped (``dag_ids``) to this test's
DAGs, so jobs of other tests on the cluster are listed but never judged. Jobs sleep on the cpu partition; every job
the test made is cancelled afterwards.

Injected, in one Airflow home: a job left running by a task that failed without cancelling it (what a task killed
for a reason the operator never hears of leaves behind), a job of a task instance that does not exist, a job whose
task is deferred on it, a job of a task that has no state yet in a running DAG run, a foreign job (another name
prefix) and a job with the suite's prefix but no job key.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.notifiers.oncall import default_alerts_file
from hybridflow.utils.slurm import SlurmJobSpec, deterministic_job_name, render_sbatch_script
from hybridflow.utils.slurm_jobs import SlurmJobKey

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "slurm_reconciler"
SOURCE = (REPO / "dags" / f"{DAG_ID}.py").read_text()
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING")

# Submits its job exactly as the suite's operator does (name and job key), then fails the way a killed worker does:
# nothing cancels the job.
LEAVES_ITS_JOB = textwrap.dedent('''
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException
    from hybridflow.operators.slurm import SlurmSubmitOperator
    from hybridflow.utils.slurm import render_sbatch_script

    class LeavesItsJob(SlurmSubmitOperator):
        def execute(self, context):
            key = self.job_key(context)
            self.hook.run(["mkdir", "-p", "--", self.log_dir])
            job_id = self.hook.submit(render_sbatch_script(self.build_spec(key.job_name, key.comment())))
            context["ti"].xcom_push(key="slurm_job_id", value=job_id)
            raise AirflowFailException(f"worker gone after submitting Slurm job {{job_id}}")

    with DAG("{dag_id}", schedule=None, catchup=False):
        LeavesItsJob(task_id="job", command=["sleep", "300"], partition="cpu", time_limit=10, requeue=False,
                     signal=None, log_dir="{log_dir}", retries=0)
''')
# A task deferred on its job, and a task after it that has no state yet while its run is running.
FOLLOWS_ITS_JOB = textwrap.dedent('''
    from airflow.sdk import DAG, task
    from hybridflow.operators.slurm import SlurmSubmitOperator

    with DAG("{dag_id}", schedule=None, catchup=False):
        @task
        def after():
            pass

        SlurmSubmitOperator(task_id="job", command=["sleep", "300"], partition="cpu", time_limit=10, requeue=False,
                            signal=None, log_dir="{log_dir}", poll_interval_s=2, retries=0,
                            wait_before_defer_s=0) >> after()
''')


@pytest.fixture
def area(slurm, stack):
    """A tag for this test's DAGs and jobs, and a log directory; afterwards every job whose name holds the tag, or
    that the test submitted, is cancelled."""
    tag = uuid.uuid4().hex[:8]
    log_dir = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/tests-reconciler-{tag}"
    slurm.run(["mkdir", "-p", "--", log_dir])
    submitted: list[str] = []
    yield tag, log_dir, submitted
    leftovers = {job.job_id for job in slurm.user_jobs().jobs if tag in job.name} | set(submitted)
    for job_id in sorted(leftovers):
        slurm.run(["scancel", job_id])
    slurm.run(["rm", "-rf", "--", log_dir])


def submit(slurm: SlurmHook, submitted: list[str], log_dir: str, name: str, comment: str | None = None) -> str:
    spec = SlurmJobSpec(job_name=name, partition="cpu", command=["sleep", "300"], time_limit=10,
                        output=f"{log_dir}/%x-%j.out", comment=comment)
    submitted.append(slurm.submit(render_sbatch_script(spec)))
    return submitted[-1]


def states(slurm: SlurmHook, job_ids) -> dict[str, str]:
    """Each job's state from Slurm itself (scontrol, then sacct)."""
    return {job_id: slurm.status(job_id).state for job_id in job_ids}


def line_of(log: str, job_id: str) -> str:
    lines = [line for line in log.splitlines() if f"slurm job {job_id} name=" in line]
    assert lines, f"no summary line for job {job_id} in the task log"
    return lines[-1]


def test_reconciler_cancels_orphans_leaves_live_foreign_and_unkeyed_jobs_and_dry_run_cancels_nothing(
        run_dag, slurm, area, task_watch, isolated_airflow_env):
    started = time.monotonic()
    deployment = isolated_airflow_env["HYBRIDFLOW_DEPLOYMENT"]  # the test's own Airflow, not the stack's
    tag, log_dir, submitted = area
    orphan_dag, live_dag, missing_dag = (f"reconciler_{kind}_{tag}" for kind in ("orphan", "live", "missing"))

    # (a) a task that failed and left its job running; a job whose task instance does not exist
    failed = run_dag(LEAVES_ITS_JOB.format(dag_id=orphan_dag, log_dir=log_dir), orphan_dag)
    assert failed["tasks"]["job"]["state"] == "failed", failed["log"][-3000:]
    orphan = failed["tasks"]["job"]["xcom"]["slurm_job_id"]
    missing_key = SlurmJobKey(dag_id=missing_dag, run_id="manual__2026-01-01T00:00:00+00:00", task_id="train",
                              deployment=deployment)
    missing = submit(slurm, submitted, log_dir, missing_key.job_name, missing_key.comment())
    # (c) ... and the same kind of job submitted by another Airflow deployment (the stack's, sharing the job user)
    elsewhere_key = replace(missing_key, task_id="train-elsewhere", deployment="another-airflow")
    elsewhere = submit(slurm, submitted, log_dir, elsewhere_key.job_name, elsewhere_key.comment())
    # (c) not the suite's to judge: another name prefix; the suite's prefix without a job key
    foreign = submit(slurm, submitted, log_dir, f"someone-elses-{tag}")
    unkeyed = submit(slurm, submitted, log_dir, deterministic_job_name(orphan_dag, "by-hand", "r"))
    # (b) a task deferred on its job
    live_run = run_dag(FOLLOWS_ITS_JOB.format(dag_id=live_dag, log_dir=log_dir), live_dag, background=True)
    try:
        task_watch.wait(live_dag, "deferred", timeout_s=120)
        (live_job,) = [job for job in slurm.user_jobs().jobs if job.name.startswith(f"hf-{live_dag}-job-")]
        live = live_job.job_id
        waiting_key = SlurmJobKey(dag_id=live_dag, run_id=SlurmJobKey.from_comment(live_job.comment).run_id,
                                  task_id="after", deployment=deployment)
        waiting = submit(slurm, submitted, log_dir, waiting_key.job_name, waiting_key.comment())
        everyone = (orphan, missing, foreign, unkeyed, elsewhere, live, waiting)
        assert all(state in LIVE_STATES for state in states(slurm, everyone).values())
        conf = {"grace_s": 0, "dag_ids": [orphan_dag, live_dag, missing_dag]}

        # (d) a dry run lists what it would cancel and cancels nothing
        dry = run_dag(SOURCE, DAG_ID, {**conf, "dry_run": True})
        assert dry["state"] == "success", dry["log"][-4000:]
        dry_pass = dry["tasks"]["reconcile"]["xcom"]["return_value"]
        assert (sorted(dry_pass["would_cancel"]), dry_pass["cancelled"]) == (sorted([orphan, missing]), [])
        assert all(state in LIVE_STATES for state in states(slurm, everyone).values())
        assert "decision=cancel" in line_of(dry["log"], orphan)
        assert line_of(dry["log"], orphan).endswith("-> dry run: not cancelled")

        cancel_started = time.monotonic()
        real = run_dag(SOURCE, DAG_ID, {**conf, "dry_run": False})
        pass_s = time.monotonic() - cancel_started
        assert real["state"] == "success", real["log"][-4000:]
        real_pass = real["tasks"]["reconcile"]["xcom"]["return_value"]
        after = states(slurm, everyone)
    finally:
        os.killpg(live_run.pid, signal.SIGKILL)
        live_run.wait()

    # cancelled within one pass, proven from Slurm's own state
    assert sorted(real_pass["cancelled"]) == sorted([orphan, missing]) and real_pass["not_cancelled"] == []
    assert (after[orphan], after[missing]) == ("CANCELLED", "CANCELLED")
    # never touched: the live task's job, the job of a task about to run, the foreign job, the job without a key
    assert all(after[job] in LIVE_STATES for job in (live, waiting, foreign, unkeyed, elsewhere)), after

    log = real["log"]
    assert f"dag={orphan_dag} run={failed['run_id']} task=job ti=failed decision=cancel" in line_of(log, orphan)
    assert line_of(log, orphan).endswith("-> CANCELLED (per scontrol)")
    assert f"dag={missing_dag} run={missing_key.run_id} task=train ti=missing decision=cancel" in line_of(log, missing)
    assert "decision=keep: task instance is" in line_of(log, live)
    assert line_of(log, live).split(" ti=")[1].split()[0] in ("deferred", "queued", "running")
    assert "task=after ti=none decision=keep: task instance has no state yet in an active DAG run" in line_of(
        log, waiting)
    assert "decision=foreign: name does not start with 'hf-'" in line_of(log, foreign)
    assert "decision=unknown: no job key in its comment" in line_of(log, unkeyed)
    assert "decision=foreign: submitted by Airflow deployment 'another-airflow'" in line_of(log, elsewhere)
    jobs = {job["job_id"]: job["decision"] for job in real_pass["jobs"]}
    assert {jobs[j] for j in (orphan, missing)} == {"cancel"} and {jobs[live], jobs[waiting]} == {"keep"}

    # on-call alerted of the cancels (the dry run alerted nothing)
    alerts = [json.loads(line) for line in default_alerts_file().read_text().splitlines()
              if f'"{DAG_ID}"' in line]
    (alert,) = [a for a in alerts if a["run_id"] == real["run_id"]]
    assert alert["kind"] == "action" and sorted(alert["job_id"].split(",")) == sorted([orphan, missing])
    assert "cancelled 2 orphaned Slurm job(s)" in alert["text"]
    assert not [a for a in alerts if a["run_id"] == dry["run_id"]]
    print(f"reconciler test: orphans {orphan} and {missing} CANCELLED by a pass of {pass_s:.1f} s; "
          f"test {time.monotonic() - started:.1f} s")
    print("\n".join(line_of(log, job_id) for job_id in everyone))
