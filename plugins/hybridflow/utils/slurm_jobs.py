"""Pure pieces of tracking one Slurm job: the commands to ask about it, and one status from their answers.

The sync hook (operators, sensors) and the async hook (triggers) run the same argv lists and feed the output
to the same functions, so both sides agree on what a job's state is. Also which job a task follows: the reattach
rule, the training generation (a new job asked for on purpose) and the job key (which task instance a job runs for).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hybridflow.exceptions import InvalidJobSpecError
from hybridflow.utils.slurm import (
    _DIRECTIVE_BREAKERS_RE,
    JOB_COMMENT_MAX_BYTES,
    SACCT_FORMAT,
    SQUEUE_FORMAT,
    SUCCESS_STATES,
    _parse_duration,
    deterministic_job_name,
    end_marker_path,
    is_final,
    latest_by_job_id,
    normalise_state,
    parse_sacct,
    parse_scontrol_show_job,
    parse_squeue,
    scontrol_exit_code,
    scontrol_restarts,
)

# How far back a lookup by name searches accounting (sacct's default is "since midnight").
NAME_LOOKUP_WINDOW = "now-14days"


@dataclass(frozen=True)
class SlurmJobStatus:
    """What is known of one job, from whichever source still knows it (scontrol, then sacct)."""

    job_id: str
    name: str
    state: str
    source: str
    exit_code: int | None = None
    exit_signal: int | None = None
    elapsed_s: float | None = None
    restarts: int = 0
    reason: str = ""
    alloc_tres: Mapping[str, str] = field(default_factory=dict)
    stdout_path: str = ""
    stderr_path: str = ""

    @property
    def succeeded(self) -> bool:
        return self.state in SUCCESS_STATES

    def final(self, requeue_enabled: bool) -> bool:
        return is_final(self.state, requeue_enabled)

    def to_event(self) -> dict:
        """JSON-safe form for trigger events and XCom."""
        event = asdict(self)
        event["alloc_tres"] = dict(self.alloc_tres)
        return event

    @classmethod
    def from_event(cls, event: Mapping) -> SlurmJobStatus:
        keys = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in event.items() if k in keys})


@dataclass(frozen=True)
class Wait:
    """The next wait of someone following a job: sleep ``seconds``, or wait on the file ``marker`` for at most
    that long (it returns the moment the file appears)."""

    seconds: float
    marker: str = ""


class EndWatch:
    """How the operator and the trigger wait between two looks at a job (shared, so both follow it alike).

    While the job runs they wait on its end marker (written by the batch shell the moment its command ends, see
    :func:`~hybridflow.utils.slurm.render_sbatch_script`): file stats on the login node, no slurmctld call, for up
    to ``max_s``. Once it appeared they poll fast (from ``fast_s``) until Slurm says the job ended, which follows
    within a second. Otherwise (pending, no marker dir) they poll with a backoff from ``min_s`` to ``max_s``,
    restarted whenever the state changes. So a job's end is seen within a fraction of a second however long it
    ran, with at most one status call per ``max_s`` while it runs, as plain polling at ``max_s``.
    """

    FAST_S = 0.2

    def __init__(self, marker_dir: str, max_s: float, min_s: float = 1.0):
        self.marker_dir, self.max_s, self.min_s = marker_dir, max_s, min_s
        self._delay = min_s
        self._seen: tuple[str, int] | None = None
        self._marked: tuple[str, int] | None = None

    def next_wait(self, status: SlurmJobStatus | None) -> Wait:
        if status is not None and (status.state, status.restarts) != self._seen:
            self._seen = (status.state, status.restarts)
            self._delay = self.min_s if self._marked != (status.job_id, status.restarts) else self.FAST_S
        if (self.marker_dir and status is not None and status.state == "RUNNING"
                and self._marked != (status.job_id, status.restarts)):
            return Wait(self.max_s, end_marker_path(self.marker_dir, status.job_id, status.restarts))
        wait = Wait(self._delay)
        self._delay = min(self._delay * 2, self.max_s)
        return wait

    def marker_seen(self, status: SlurmJobStatus) -> None:
        """The batch shell of this run of the job marked its end: poll fast until Slurm agrees."""
        self._marked = (status.job_id, status.restarts)
        self._delay = self.FAST_S


def scontrol_argv(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", "--oneliner", job_id]


def sacct_argv(job_id: str) -> list[str]:
    return ["sacct", "-X", "-P", "-n", "-j", job_id, f"--format={SACCT_FORMAT}"]


def squeue_by_name_argv(name: str) -> list[str]:
    # --states=all also lists jobs that ended within MinJobAge, which sacct may still show as "allocation".
    return ["squeue", "--noheader", "--states=all", f"--name={name}", "-o", SQUEUE_FORMAT]


def sacct_by_name_argv(name: str) -> list[str]:
    return ["sacct", "-X", "-P", "-n", f"--name={name}", f"--starttime={NAME_LOOKUP_WINDOW}",
            f"--format={SACCT_FORMAT}"]


def scontrol_says_unknown(returncode: int, stderr: str) -> bool:
    """After MinJobAge the controller forgets a job: only accounting knows it then."""
    return returncode != 0 and "Invalid job id" in stderr


def status_from_scontrol(stdout: str) -> SlurmJobStatus:
    fields = parse_scontrol_show_job(stdout)
    state, _ = normalise_state(fields.get("JobState", ""))
    code, signal = scontrol_exit_code(fields)
    tres = dict(item.split("=", 1) for item in fields.get("TRES", "").split(",") if "=" in item)
    return SlurmJobStatus(
        job_id=fields["JobId"], name=fields.get("JobName", ""), state=state, source="scontrol",
        exit_code=code, exit_signal=signal, elapsed_s=_parse_duration(fields.get("RunTime", "0:0:0")),
        restarts=scontrol_restarts(fields), reason=fields.get("Reason", ""), alloc_tres=tres,
        stdout_path=fields.get("StdOut", ""), stderr_path=fields.get("StdErr", ""),
    )


def status_from_sacct(stdout: str, job_id: str) -> SlurmJobStatus | None:
    record = latest_by_job_id(parse_sacct(stdout)).get(job_id)
    if record is None:
        return None
    return SlurmJobStatus(
        job_id=record.job_id, name=record.job_name, state=record.state, source="sacct",
        exit_code=record.exit_code, exit_signal=record.exit_signal, elapsed_s=record.elapsed_seconds,
        alloc_tres=dict(record.alloc_tres),
    )


def job_ids_by_name(squeue_stdout: str, sacct_stdout: str, name: str) -> list[str]:
    """Every job id carrying this name in the queue or in accounting, oldest first."""
    ids = {r.job_id for r in parse_squeue(squeue_stdout) if r.name == name}
    ids |= {r.job_id for r in parse_sacct(sacct_stdout) if r.job_name == name}
    return sorted(ids, key=int)


def job_to_reattach(statuses: Iterable[SlurmJobStatus], requeue_enabled: bool) -> SlurmJobStatus | None:
    """
    The job a (re)started task should follow instead of submitting: the newest one still alive, else the newest
    one that succeeded. A job that failed belonged to a try that failed; a retry submits anew.
    """
    ordered = sorted(statuses, key=lambda s: int(s.job_id), reverse=True)
    for status in ordered:
        if not status.final(requeue_enabled):
            return status
    for status in ordered:
        if status.succeeded:
            return status
    return None


# --- Training generations: a new job on purpose --------------------------------------------------------------
# A task's job name comes from its DAG, task and run, so clearing a task whose job COMPLETED follows that job again:
# right after a crash, wrong when the data was fixed and a fresh model is wanted. Generation N > 0 names another job
# and another run directory (layout.TrainingRunDir.for_generation); generation 0 keeps today's names, so jobs
# submitted before generations existed are still found. Each generation is submitted at most once, like generation 0.

MAX_GENERATION = 1000


def generation(value: Any) -> int:
    """The generation from a param or a rendered template (text): a whole number in [0, MAX_GENERATION]."""
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,4}\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GENERATION:
        raise InvalidJobSpecError(f"retrain={value!r} is invalid: use a whole number from 0 to {MAX_GENERATION}")
    return value


def generation_task_key(task_id: str, generation: int) -> str:
    """What stands for the task in the job name of ``generation``. No task id holds '@', so no real task (such as
    a group ``train`` with a task ``retrain-1``) can share the key and with it the job."""
    return task_id if generation == 0 else f"{task_id}@retrain-{generation}"


# --- Job keys: which task instance a job runs for -------------------------------------------------------------
# A job's name comes from its task instance but cannot be read back: the ids are sanitised and shortened, and a
# digest ends it. So the operator also writes the task instance into the job's comment, as JSON; the orphan
# reconciler reads it back and believes it only when it gives back the job's own name. A job without one (submitted
# before keys existed, or not by the suite's operators) has no task instance to judge and is never touched.

JOB_KEY_VERSION = 1
DEFAULT_DEPLOYMENT = "default"  # pipeline.yaml reconciler.deployment when HYBRIDFLOW_DEPLOYMENT is not set
_JOB_KEY_FIELDS = {"dag_id": str, "run_id": str, "task_id": str, "map_index": int, "retrain": int,
                   "deployment": str, "v": int}


@dataclass(frozen=True)
class SlurmJobKey:
    """The task instance a job of the suite's runs for (and its training generation); it makes the job's name.

    :param map_index: the mapped task's index, -1 for a task that is not mapped.
    :param retrain: the training generation (:func:`generation`); 0 for every job that is not a retrain.
    :param deployment: the Airflow deployment that submitted it (pipeline.yaml ``reconciler.deployment``).
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    retrain: int = 0
    deployment: str = DEFAULT_DEPLOYMENT

    @property
    def job_name(self) -> str:
        """The job's name: ``<task_id>[.<map_index>][@retrain-N]`` in :func:`deterministic_job_name`."""
        task = self.task_id if self.map_index < 0 else f"{self.task_id}.{self.map_index}"
        return deterministic_job_name(self.dag_id, generation_task_key(task, self.retrain), self.run_id)

    def comment(self) -> str | None:
        """The key as the job's comment (compact JSON), or None where sbatch could not carry it intact: a comment
        over ``JOB_COMMENT_MAX_BYTES``, or one holding a backslash or a control character (an ``#SBATCH`` line
        drops backslashes). Airflow's ids never need either by default; a job without a key is never reconciled."""
        text = json.dumps({"dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id,
                           "map_index": self.map_index, "retrain": self.retrain, "deployment": self.deployment,
                           "v": JOB_KEY_VERSION},
                          ensure_ascii=False, separators=(",", ":"))
        if _DIRECTIVE_BREAKERS_RE.search(text) or len(text.encode()) > JOB_COMMENT_MAX_BYTES:
            return None
        return text

    @classmethod
    def from_comment(cls, text: str) -> SlurmJobKey | None:
        """The key a job's comment holds, or None for any comment that is not exactly one."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.keys() != _JOB_KEY_FIELDS.keys() or data["v"] != JOB_KEY_VERSION:
            return None
        if any(type(data[name]) is not kind for name, kind in _JOB_KEY_FIELDS.items()):  # bool is not an int here
            return None
        if not all((data["dag_id"], data["run_id"], data["task_id"])) or data["map_index"] < -1:
            return None
        if not 0 <= data["retrain"] <= MAX_GENERATION:
            return None
        return cls(dag_id=data["dag_id"], run_id=data["run_id"], task_id=data["task_id"],
                   map_index=data["map_index"], retrain=data["retrain"], deployment=data["deployment"])
