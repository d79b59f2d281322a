"""Pure pieces of the Slurm orphan reconciler: the job user's jobs as squeue lists them, whose each one is, and what
to do with it.

A job is the suite's to judge only when all of these hold: it belongs to the job user (the SSH login every job of
the suite is submitted as), its name has the suite's prefix, its comment holds a job key
(:class:`~hybridflow.utils.slurm_jobs.SlurmJobKey`), and that key gives back the job's own name. Anything else is
reported and never touched. A judged job is cancelled when its task instance is not live and the job is older than
the grace period; a task instance without a state in a DAG run that is still active (cleared, about to be
scheduled) counts as live, since it will follow the job again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.slurm import NON_FINAL_STATES, normalise_state
from hybridflow.utils.slurm_jobs import DEFAULT_DEPLOYMENT, SlurmJobKey

__all__ = [
    "ACTIVE_RUN_STATES",
    "CLUSTER_CLOCK_ARGV",
    "LIVE_TI_STATES",
    "MAX_GRACE_S",
    "SUITE_JOB_NAME_PREFIX",
    "USER_JOBS_FORMAT",
    "Decision",
    "JobListing",
    "ListedJob",
    "TaskLook",
    "Verdict",
    "judge",
    "parse_cluster_clock",
    "parse_user_jobs",
    "state_in",
    "summary_line",
    "user_jobs_argv",
]

# Task instance states in which the task runs, will run, or waits to run again, and so follows its job.
LIVE_TI_STATES = frozenset(
    {"scheduled", "queued", "running", "deferred", "up_for_retry", "up_for_reschedule", "restarting"})
ACTIVE_RUN_STATES = frozenset({"queued", "running"})
SUITE_JOB_NAME_PREFIX = "hf-"  # deterministic_job_name's default prefix and its separator
MAX_GRACE_S = 86_400

# squeue --noheader --user=<user> -o <USER_JOBS_FORMAT>, under SLURM_TIME_FORMAT=%s
# Job id | user | state (long) | submit time | name | comment. SLURM_TIME_FORMAT=%s prints the submit time as epoch
# seconds (measured on 22.05.8), so the job's age comes from the cluster's own clock and `date +%s` there, whatever
# the time zones. Without --states squeue lists what the controller still queues or runs. The comment is known to
# the controller only: accounting keeps none without AccountingStoreFlags=job_comment.
USER_JOBS_FORMAT = "%i|%u|%T|%V|%j|%k"
_USER_JOBS_FIELD_COUNT = USER_JOBS_FORMAT.count("|") + 1
CLUSTER_CLOCK_ARGV = ("date", "+%s")
# POSIX names, and the dots and @ of directory-service names; never an option.
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@-]{0,63}")
_JOB_ID_RE = re.compile(r"[0-9]+(_[0-9]+)?")
_EPOCH_RE = re.compile(r"[0-9]{1,12}")


def user_jobs_argv(user: str) -> list[str]:
    """The squeue that lists every job of ``user`` the controller still holds (``env`` sets the time format)."""
    if not isinstance(user, str) or not _USER_RE.fullmatch(user):
        raise ValueError(f"job user {user!r} is not a user name")
    return ["env", "SLURM_TIME_FORMAT=%s", "squeue", "--noheader", f"--user={user}", "-o", USER_JOBS_FORMAT]


def parse_cluster_clock(stdout: str) -> int:
    """Epoch seconds from ``date +%s`` on the login node."""
    text = stdout.strip()
    if not _EPOCH_RE.fullmatch(text):
        raise SlurmOutputParseError(f"`date +%s` on the login node printed {stdout!r}; expected epoch seconds")
    return int(text)


@dataclass(frozen=True)
class ListedJob:
    """One line of the job user's squeue; ``submitted_s`` in epoch seconds."""

    job_id: str
    user: str
    state: str
    submitted_s: int
    name: str
    comment: str


@dataclass(frozen=True)
class JobListing:
    """What the cluster holds for the job user, when (its own clock), and the lines that could not be read."""

    user: str
    now_s: int
    jobs: tuple[ListedJob, ...]
    unreadable: tuple[str, ...] = ()


def parse_user_jobs(stdout: str) -> tuple[list[ListedJob], list[str]]:
    """Jobs of ``squeue -o USER_JOBS_FORMAT``, and the lines that are not one job exactly (a ``|`` in a name or
    comment, a pending array, a state or time the parser does not know): those are left alone, never guessed."""
    jobs, unreadable = [], []
    for line in filter(str.strip, stdout.splitlines()):
        fields = line.split("|")
        if len(fields) != _USER_JOBS_FIELD_COUNT:
            unreadable.append(line)
            continue
        job_id, user, state, submitted, name, comment = fields
        try:
            base_state, _ = normalise_state(state)
        except SlurmOutputParseError:
            unreadable.append(line)
            continue
        if not _JOB_ID_RE.fullmatch(job_id) or not _EPOCH_RE.fullmatch(submitted):
            unreadable.append(line)
            continue
        jobs.append(ListedJob(job_id=job_id, user=user, state=base_state, submitted_s=int(submitted), name=name,
                              comment=comment))
    return jobs, unreadable


@dataclass(frozen=True)
class TaskLook:
    """What Airflow says of a job's task instance: whether it exists, its state (None: none yet), and for one
    without a state whether its DAG run is still active."""

    found: bool
    state: str | None = None
    run_active: bool = False

    @property
    def label(self) -> str:
        if not self.found:
            return "missing"
        return self.state or "none"


def state_in(task_states: Mapping[str, Mapping[str, Any]], key: SlurmJobKey) -> tuple[bool, str | None]:
    """Whether an answer of the Task SDK's ``get_task_states`` (``{run_id: {task_id, or <task_id>_<map_index> for a
    mapped one: state}}``, asked for the key's task and run) holds the key's task instance, and its state."""
    by_task = task_states.get(key.run_id) or {}
    name = key.task_id if key.map_index < 0 else f"{key.task_id}_{key.map_index}"
    if name not in by_task:
        return False, None
    state = by_task[name]
    return True, None if state is None else str(getattr(state, "value", state))


class Verdict(StrEnum):
    CANCEL = "cancel"  # its task instance is not live and the job is past the grace period
    KEEP = "keep"  # its task instance is live: the task follows the job
    TOO_YOUNG = "too-young"  # not live, but the job is younger than the grace period: looked at again next time
    FOREIGN = "foreign"  # another user's job, a name without the suite's prefix, or another deployment's job
    UNKNOWN = "unknown"  # the suite's prefix, but no job key that gives back its name
    OUT_OF_SCOPE = "out-of-scope"  # the suite's job, of a DAG this run was not asked about
    ENDING = "ending"  # already finishing: nothing to cancel


@dataclass(frozen=True)
class Decision:
    """What the reconciler does with one job, and why; ``ti`` is the task instance's state as looked up
    (``missing``, ``none``, or a state), empty when it was not looked up."""

    job: ListedJob
    verdict: Verdict
    reason: str
    age_s: int
    key: SlurmJobKey | None = None
    ti: str = ""

    def to_dict(self) -> dict[str, Any]:
        key = self.key
        return {"job_id": self.job.job_id, "name": self.job.name, "user": self.job.user, "state": self.job.state,
                "age_s": self.age_s, "dag_id": key and key.dag_id, "run_id": key and key.run_id,
                "task_id": key and key.task_id, "map_index": key and key.map_index, "ti_state": self.ti,
                "decision": str(self.verdict), "reason": self.reason}


def judge(job: ListedJob, *, user: str, now_s: int, grace_s: int, look_up: Callable[[SlurmJobKey], TaskLook],
          dag_ids: Collection[str] = (), deployment: str = DEFAULT_DEPLOYMENT) -> Decision:
    """What to do with ``job``. ``look_up`` gives its task instance; it is asked only for the suite's own jobs.

    :param user: the suite's job user; anyone else's job is foreign.
    :param now_s: the cluster's clock at the listing (the job's age is taken on the same clock as its submit time).
    :param grace_s: a job is cancelled only once it is at least this old.
    :param dag_ids: judge only jobs of these DAGs (empty: every DAG).
    :param deployment: this Airflow deployment; a job another one submitted is foreign to this one.
    """
    age_s = max(now_s - job.submitted_s, 0)

    def decided(verdict: Verdict, reason: str, key: SlurmJobKey | None = None, ti: str = "") -> Decision:
        return Decision(job=job, verdict=verdict, reason=reason, age_s=age_s, key=key, ti=ti)

    if job.user != user:
        return decided(Verdict.FOREIGN, f"user {job.user!r} is not the suite's job user {user!r}")
    if not job.name.startswith(SUITE_JOB_NAME_PREFIX):
        return decided(Verdict.FOREIGN, f"name does not start with {SUITE_JOB_NAME_PREFIX!r}")
    if job.state not in NON_FINAL_STATES or job.state == "COMPLETING":
        return decided(Verdict.ENDING, f"already {job.state}")
    key = SlurmJobKey.from_comment(job.comment)
    if key is None:
        return decided(Verdict.UNKNOWN, "no job key in its comment (submitted before keys, or not by the suite's "
                                        "operators)")
    if key.job_name != job.name:
        return decided(Verdict.UNKNOWN, f"the key in its comment names another job ({key.job_name})", key)
    if key.deployment != deployment:
        return decided(Verdict.FOREIGN, f"submitted by Airflow deployment {key.deployment!r}, not {deployment!r}", key)
    if dag_ids and key.dag_id not in dag_ids:
        return decided(Verdict.OUT_OF_SCOPE, "its DAG is not in this run's dag_ids", key)
    look = look_up(key)
    if look.found and look.state in LIVE_TI_STATES:
        return decided(Verdict.KEEP, f"task instance is {look.state}", key, look.label)
    if look.found and look.state is None and look.run_active:
        return decided(Verdict.KEEP, "task instance has no state yet in an active DAG run (cleared or not yet "
                                     "scheduled): it will follow the job", key, look.label)
    why = "no such task instance" if not look.found else f"task instance is {look.label}"
    if age_s < grace_s:
        return decided(Verdict.TOO_YOUNG, f"{why}, but the job is {age_s} s old, under the grace of {grace_s} s",
                       key, look.label)
    return decided(Verdict.CANCEL, f"{why} and the job is {age_s} s old (grace {grace_s} s)", key, look.label)


def summary_line(decision: Decision, outcome: str = "") -> str:
    """One log line per job: id, name, DAG/run/task, the task instance's state, the decision, and what came of it."""
    job, key = decision.job, decision.key
    where = "dag=- run=- task=-"
    if key is not None:
        task = key.task_id + (f"[{key.map_index}]" if key.map_index >= 0 else "")
        task += f"@retrain-{key.retrain}" if key.retrain else ""
        where = f"dag={key.dag_id} run={key.run_id} task={task}"
    line = (f"slurm job {job.job_id} name={job.name} user={job.user} state={job.state} age={decision.age_s}s "
            f"{where} ti={decision.ti or '-'} decision={decision.verdict}: {decision.reason}")
    return f"{line} -> {outcome}" if outcome else line
