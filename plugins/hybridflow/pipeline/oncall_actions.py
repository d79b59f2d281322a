"""On-call actions on a training job of ours: cancel it or requeue it, each verified from the job's own state.

A job is ours when its name is one :func:`hybridflow.utils.slurm.deterministic_job_name` makes (the suite's
prefix, the ids, a 16-hex digest); any other job on the partition belongs to someone else and is refused, and
so is a job that has already finished. Each action is then checked against what Slurm says, because
``scancel`` exits 0 even when it did nothing. :func:`look_up` records the state before; :func:`act` is safe to
retry: it sees that an earlier try already cancelled or requeued the job, and only verifies.
"""

from __future__ import annotations

import inspect
import re
import time
from typing import TYPE_CHECKING

from hybridflow.exceptions import JobActionFailed, JobActionRefused
from hybridflow.utils.slurm import deterministic_job_name

if TYPE_CHECKING:
    from hybridflow.hooks.mlflow import MlflowHook
    from hybridflow.hooks.slurm import SlurmHook
    from hybridflow.utils.slurm_jobs import SlurmJobStatus

RUNBOOK = "include/runbooks/oncall.md"
ACTIONS = ("cancel", "requeue")
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
JOB_NAME_PREFIX = inspect.signature(deterministic_job_name).parameters["prefix"].default + "-"
OUR_JOB_NAME = re.compile(rf"{re.escape(JOB_NAME_PREFIX)}[A-Za-z0-9._-]+-[0-9a-f]{{16}}")
# A requeued job is back in the queue, or already started again.
REQUEUED_STATES = ("PENDING", "REQUEUED", "CONFIGURING", "RUNNING")
REQUEUEABLE_STATES = ("RUNNING", "SUSPENDED")


def describe(status: SlurmJobStatus) -> str:
    return f"Slurm job {status.job_id} ({status.name!r}, {status.state}, restarts {status.restarts})"


def look_up(hook: SlurmHook, job_id: str, action: str) -> dict:
    """The job's state before the action; refuses unknown, foreign or finished jobs and impossible actions."""
    if not JOB_ID.fullmatch(job_id):
        raise JobActionRefused(f"job id {job_id!r} is not a Slurm job id (digits, or <array id>_<task>)")
    if action not in ACTIONS:
        raise JobActionRefused(f"action {action!r} is not one of {', '.join(ACTIONS)}")
    status = hook.status(job_id)
    if status is None:
        raise JobActionRefused(f"Slurm on {hook.endpoint} knows no job {job_id} (neither the controller nor "
                               f"accounting); check the id with `sacct -j {job_id}`. Runbook: {RUNBOOK}")
    if not OUR_JOB_NAME.fullmatch(status.name):
        raise JobActionRefused(f"{describe(status)} is not one of ours: its name does not start with "
                               f"{JOB_NAME_PREFIX!r} and end with the digest deterministic_job_name gives. "
                               "On-call acts only on the suite's own jobs; ask the job's owner.")
    if status.final(requeue_enabled=True):
        raise JobActionRefused(f"{describe(status)} has already finished; nothing to {action}. "
                               f"Runbook: {RUNBOOK}")
    if action == "requeue" and status.state not in REQUEUEABLE_STATES:
        raise JobActionRefused(f"{describe(status)} is not running, so there is nothing to requeue (a "
                               f"pending job is already in the queue). Runbook: {RUNBOOK}")
    return status.to_event()


def act(hook: SlurmHook, before: dict, action: str, wait_s: float = 60) -> SlurmJobStatus:
    """Cancel or requeue the job ``before`` describes; returns its state after, verified."""
    job_id = before["job_id"]
    status = hook.status(job_id)
    if action == "cancel":
        if status is None or status.state != "CANCELLED":
            status = hook.cancel(job_id)
        if status is None or status.state != "CANCELLED":
            raise JobActionFailed(f"scancel {job_id} did not cancel it: now {_state(status)}. Check "
                                  f"`sacct -j {job_id}`, then `scancel --signal=KILL {job_id}`. "
                                  f"Runbook: {RUNBOOK}")
        return status
    if status is not None and status.restarts <= before["restarts"]:
        result = hook.run(["scontrol", "requeue", job_id])
        if result.returncode != 0:
            raise JobActionFailed(f"scontrol requeue {job_id} refused: {result.stderr.strip()}. A job "
                                  "submitted with --no-requeue cannot be requeued: cancel it and clear the "
                                  "training task, which resubmits and resumes from its newest checkpoint. "
                                  f"Runbook: {RUNBOOK}")
    deadline = time.monotonic() + wait_s
    while not _requeued(status, before) and time.monotonic() < deadline:
        time.sleep(1)
        status = hook.status(job_id)
    if not _requeued(status, before):
        raise JobActionFailed(f"Slurm job {job_id} did not go back to the queue within {wait_s:.0f} s: now "
                              f"{_state(status)}. Runbook: {RUNBOOK}")
    return status


def _state(status: SlurmJobStatus | None) -> str:
    return "unknown to Slurm" if status is None else f"{status.state}, restarts {status.restarts}"


def _requeued(status: SlurmJobStatus | None, before: dict) -> bool:
    return status is not None and status.state in REQUEUED_STATES and status.restarts > before["restarts"]


def record_in_mlflow(mlflow: MlflowHook, experiment: str, action: dict, requested_by: str) -> str:
    """Tag the training run of the job an on-call action touched with what was done and why (the run is found by
    its job name's digest, so any name reaches the search as hex only); says so when the job has no run."""
    from hybridflow.pipeline.registry import utc_now
    from hybridflow.utils import mlflow_tracking as tracking

    name = (action.get("before") or {}).get("name") or ""
    run = mlflow.find_run_by_tag(mlflow.experiment_id(experiment), tracking.JOB_NAME_SHA_TAG,
                                 tracking.job_name_sha(name))
    if run is None:
        return f"no MLflow run of experiment {experiment!r} belongs to Slurm job {action.get('job_id')} ({name!r})"
    mlflow.log_batch(run["info"]["run_id"], tags=tracking.oncall_tag(action, utc_now(), requested_by))
    return f"recorded on MLflow run {run['info']['run_id']}"
