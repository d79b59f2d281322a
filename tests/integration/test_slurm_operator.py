"""SlurmSubmitOperator and SlurmJobTrigger against the real local Slurm over real SSH, through Airflow's task
lifecycle (execute -> defer -> trigger -> execute_complete) in dag.test()."""

from __future__ import annotations

import time
import uuid

import pytest
from helpers.slurm_dags import slurm_dag
from hybridflow.exceptions import SlurmJobFailed
from hybridflow.hooks.slurm import SlurmHook


def test_slurm_operator_runs_a_gpu_job_to_completed_through_the_trigger(run_dag, log_dir):
    dag_id = f"t_slurm_ok_{uuid.uuid4().hex[:6]}"
    script = ('echo "{\\"step\\": 3, \\"total_steps\\": 6, \\"loss\\": 0.5}" > ' + log_dir + '/progress.json; '
              'echo "gpus=$CUDA_VISIBLE_DEVICES"; sleep 3; echo done-ok')
    result = run_dag(slurm_dag(dag_id, ["bash", "-c", script], log_dir, progress_path=f"{log_dir}/progress.json"),
                     dag_id)
    assert result["state"] == "success", result["log"][-3000:]
    task = result["tasks"]["job"]
    job_id = task["xcom"]["slurm_job_id"]
    returned = task["xcom"]["return_value"]
    assert returned["state"] == "COMPLETED" and returned["job_id"] == job_id
    assert returned["alloc_tres"]["gres/gpu"] == "1"
    # its efficiency from Slurm's accounting: the return value and its own XCom agree, nothing made up
    efficiency = task["xcom"]["efficiency"]
    assert returned["efficiency"] == efficiency and efficiency["job_id"] == job_id
    assert efficiency.get("runs") == 1, efficiency  # not_measured says why, where accounting was not read
    assert efficiency["gpus"] == 1 and 3 <= efficiency["elapsed_s"] <= 6 and efficiency["queue_wait_s"] >= 0
    assert efficiency["gpu_hours_allocated"] == round(efficiency["elapsed_s"] / 3600, 4)
    assert efficiency["cpu_efficiency"] is not None or "cpu_efficiency" in efficiency["not_measured"]
    assert "efficiency: queued" in result["log"]
    assert "done-ok" in result["log"]  # the job's stdout tail reached the task log
    assert "deferring" in result["log"].lower() or "Slurm job" in result["log"]


def test_slurm_operator_failed_job_names_state_exit_code_stderr_and_runbook(run_dag, log_dir):
    dag_id = f"t_slurm_fail_{uuid.uuid4().hex[:6]}"
    result = run_dag(slurm_dag(dag_id, ["bash", "-c", "echo boom-on-stderr >&2; exit 3"], log_dir, progress_path=""),
                     dag_id)
    assert result["state"] == "failed"
    log = result["log"]
    job_id = result["tasks"]["job"]["xcom"]["slurm_job_id"]
    assert f"Slurm job {job_id}" in log
    assert "ended FAILED with exit code 3:0" in log
    assert "boom-on-stderr" in log
    assert "Runbook: include/runbooks/training.md" in log


def test_slurm_operator_retry_reattaches_instead_of_submitting_twice(stack, log_dir, jobs_named):
    """A retry (a new try of the same task in the same run) finds the job by its deterministic name."""
    from hybridflow.operators.slurm import SlurmSubmitOperator
    from hybridflow.utils.slurm import deterministic_job_name
    from hybridflow.utils.slurm_jobs import job_to_reattach

    op = SlurmSubmitOperator(task_id="job", command=["sleep", "20"], partition="gpu-training", log_dir=log_dir,
                             gpus_per_node=1)
    name = deterministic_job_name("d", f"t-{uuid.uuid4().hex[:6]}", "manual__2026-01-01T00:00:00+00:00")
    from hybridflow.utils.slurm import render_sbatch_script

    op.hook.run(["mkdir", "-p", log_dir])
    first = op.hook.submit(render_sbatch_script(op.build_spec(name)))
    try:
        # what a retry does before it would submit: look the name up in the queue and in accounting
        found = job_to_reattach(op.hook.find_by_name(name), requeue_enabled=True)
        assert found is not None and found.job_id == first
        assert jobs_named(name) == [first]
    finally:
        op.hook.cancel(first)


def test_slurm_operator_on_kill_cancels_the_running_job(stack, log_dir):
    from hybridflow.operators.slurm import SlurmSubmitOperator
    from hybridflow.utils.slurm import deterministic_job_name, render_sbatch_script

    op = SlurmSubmitOperator(task_id="job", command=["sleep", "300"], partition="gpu-training", log_dir=log_dir)
    name = deterministic_job_name("d", f"kill-{uuid.uuid4().hex[:6]}", "r")
    op.hook.run(["mkdir", "-p", log_dir])
    op.job_id = op.hook.submit(render_sbatch_script(op.build_spec(name)))
    deadline = time.monotonic() + 30
    while op.hook.status(op.job_id).state != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    op.on_kill()
    assert op.hook.status(op.job_id).state == "CANCELLED"


def test_slurm_operator_failure_message_from_a_real_failed_job(stack, log_dir):
    """_finish on a real failed job: the message an on-call engineer reads."""
    from hybridflow.operators.slurm import SlurmSubmitOperator
    from hybridflow.utils.slurm import deterministic_job_name, render_sbatch_script

    op = SlurmSubmitOperator(task_id="job", command=["bash", "-c", "echo oops >&2; exit 7"],
                             partition="gpu-training", log_dir=log_dir)
    op.hook.run(["mkdir", "-p", log_dir])
    job_id = op.hook.submit(render_sbatch_script(op.build_spec(deterministic_job_name("d", "fail", uuid.uuid4().hex))))
    deadline = time.monotonic() + 30
    status = op.hook.status(job_id)
    while not status.final(False) and time.monotonic() < deadline:
        time.sleep(0.5)
        status = op.hook.status(job_id)
    with pytest.raises(SlurmJobFailed, match=rf"Slurm job {job_id} .* ended FAILED with exit code 7:0") as err:
        op._finish(status)
    assert "oops" in str(err.value)


@pytest.mark.parametrize("deferrable", [False, True], ids=["killed-while-polling", "killed-while-deferred"])
def test_slurm_operator_task_killed_mid_wait_then_rerun_reattaches_to_the_one_job(run_dag, log_dir, deferrable,
                                                                                  jobs_named, task_watch):
    """SIGKILL the process running the task while it waits for its job, then run the task again for the same
    DAG run (same run id, so the same job name): it must follow the first job, never submit a second."""
    import os
    import signal

    dag_id = f"t_slurm_kill_{uuid.uuid4().hex[:6]}"
    source = slurm_dag(dag_id, ["bash", "-c", "sleep 12; echo finished-once"], log_dir, progress_path="",
                       deferrable=deferrable)
    logical_date = "2026-01-01T00:00:00+00:00"
    first = run_dag(source, dag_id, logical_date=logical_date, background=True)
    prefix = f"hf-{dag_id}-job-"
    deadline = time.monotonic() + 120
    while not jobs_named(prefix) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs_named(prefix), "the first try never submitted"
    # Kill it in the wait it is meant to be killed in: handed to its trigger, or polling in execute().
    before_kill = task_watch.wait(dag_id, "deferred" if deferrable else "polling")
    assert first.poll() is None, f"the first try ended before it could be killed (task instance {before_kill})"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

    result = run_dag(source, dag_id, logical_date=logical_date)
    assert result["state"] == "success", result["log"][-3000:]
    assert "Reattaching to Slurm job" in result["log"]
    (job_id,) = jobs_named(prefix)  # exactly one job with this run's name, in the queue and in accounting
    assert result["tasks"]["job"]["xcom"]["slurm_job_id"] == job_id
    outputs = SlurmHook().run(["bash", "-c", f"cat {log_dir}/*-{job_id}.out"]).stdout
    assert outputs.count("finished-once") == 1
