"""Slurm 22.05 batch-script builder and output parsers: pure functions over text, standard library only.

Hooks own the SSH connection and run the commands; this module only turns a :class:`SlurmJobSpec` into the
text handed to ``sbatch`` and turns what Slurm prints back into records. Each parser expects the exact
command line documented next to its format constant and raises :class:`SlurmOutputParseError` quoting the
text it could not read.

Formats were checked against a live Slurm 22.05.8 (Debian 12, select/cons_tres, gres/gpu with type h200,
slurmdbd accounting). Dates are read in Slurm's default ``SLURM_TIME_FORMAT``: ISO 8601, cluster local time.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from hybridflow.exceptions import InvalidJobSpecError, SlurmOutputParseError

__all__ = [
    "JOB_COMMENT_MAX_BYTES",
    "JOB_NAME_MAX_LENGTH",
    "NON_FINAL_STATES",
    "REQUEUE_PENDING_STATES",
    "SACCT_FORMAT",
    "SCHEDULABLE_NODE_STATES",
    "SINFO_GPU_FORMAT",
    "SQUEUE_FORMAT",
    "SUCCESS_STATES",
    "GresSpec",
    "SacctRecord",
    "SinfoNode",
    "SlurmJobSpec",
    "SqueueRecord",
    "deterministic_job_name",
    "end_marker_path",
    "gpu_count",
    "is_final",
    "latest_by_job_id",
    "normalise_state",
    "parse_gres",
    "parse_sacct",
    "parse_sbatch_parsable",
    "parse_scontrol_show_job",
    "parse_sinfo_gpus",
    "parse_squeue",
    "render_sbatch_script",
    "node_check_argv",
    "srun_argv",
    "wait_for_file_argv",
    "scontrol_exit_code",
    "scontrol_job_state",
    "scontrol_restarts",
]

JOB_NAME_MAX_LENGTH = 200
# slurmctld refuses a longer --comment ("parameter too long"; measured on 22.05.8: 1024 bytes taken, 1025 not).
JOB_COMMENT_MAX_BYTES = 1024
_JOB_NAME_DIGEST_LENGTH = 16

# --- Job states ---------------------------------------------------------------------------------------------

# A job in one of these states has not finished; anything else (including a state this list does not know)
# ends the wait, so a new Slurm state fails the task with the state in its message instead of polling forever.
NON_FINAL_STATES = (
    "PENDING",
    "RUNNING",
    "COMPLETING",
    "CONFIGURING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
    "RESV_DEL_HOLD",
    "STOPPED",
)
# Final on their own, but Slurm puts a job submitted with --requeue back to PENDING (sacct: REQUEUED) after
# them; measured for NODE_FAIL on 22.05.8. A caller reading such a state for a requeue-enabled job keeps
# waiting, and should bound that wait: Slurm stops requeueing after MaxBatchRequeue (default 5) attempts.
REQUEUE_PENDING_STATES = ("PREEMPTED", "NODE_FAIL")
SUCCESS_STATES = ("COMPLETED",)

_STATE_RE = re.compile(r"(?P<state>[A-Z][A-Z_]*)(?: by (?P<uid>\d+))?")


def normalise_state(text: str) -> tuple[str, int | None]:
    """Split a Slurm job state such as ``"CANCELLED by 1001"`` into ``("CANCELLED", 1001)``.

    :raises SlurmOutputParseError: when the text is not an upper-case Slurm state.
    """
    match = _STATE_RE.fullmatch(text.strip())
    if match is None:
        raise SlurmOutputParseError(f"Not a Slurm job state: {text!r}")
    uid = match.group("uid")
    return match.group("state"), None if uid is None else int(uid)


def is_final(state: str, requeue_enabled: bool) -> bool:
    """Whether a job in ``state`` has finished for good.

    :param state: a job state as sacct, squeue or scontrol print it (``"CANCELLED by 0"`` is accepted).
    :param requeue_enabled: the job was submitted with ``--requeue``; then PREEMPTED and NODE_FAIL are not
        final because Slurm queues the job again.
    :return: False for the states in ``NON_FINAL_STATES``; True for every other state, unknown ones included.
    """
    base, _ = normalise_state(state)
    if base in NON_FINAL_STATES:
        return False
    return not (requeue_enabled and base in REQUEUE_PENDING_STATES)


# --- Job spec -----------------------------------------------------------------------------------------------

_SLURM_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_CONSTRAINT_RE = re.compile(r"[A-Za-z0-9._:,&|!()\[\]*-]+")
_MEM_RE = re.compile(r"[1-9][0-9]*[KMGT]?")
_TIME_HMS_RE = re.compile(r"(?P<hours>\d+):(?P<minutes>[0-5]\d):(?P<seconds>[0-5]\d)")
_TIME_DHMS_RE = re.compile(
    r"(?P<days>\d+)-(?P<hours>[01]?\d|2[0-3]):(?P<minutes>[0-5]\d):(?P<seconds>[0-5]\d)"
)
_SIGNAL_RE = re.compile(r"(?:SIG)?(?P<name>[A-Z][A-Z0-9]*)@(?P<seconds>\d+)")
_SIGNAL_MAX_SECONDS = 65535
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# sbatch reads #SBATCH lines itself, not through a shell: it honours single and double quotes (so shlex.quote
# output is read back intact, measured) but drops backslashes even inside single quotes, and a line break
# would end the directive. Values that reach a directive line may therefore contain neither.
_DIRECTIVE_BREAKERS_RE = re.compile(r"[\x00-\x1f\x7f\\]")


def whole_number(value: object, field_name: str) -> int:
    """A count from a DAG as an int: an int, or a rendered template's text (``"{{ params.gpus_per_node }}"``
    renders to ``"2"``). The one conversion at the operator and sensor boundary; the params' schemas bound the
    value before it gets here. Anything else names the field."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise InvalidJobSpecError(f"{field_name}={value!r} is invalid: use a whole number")


def _fail(field_name: str, value: object, fix: str) -> InvalidJobSpecError:
    return InvalidJobSpecError(f"SlurmJobSpec.{field_name}={value!r} is invalid: {fix}")


def _check_int(field_name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(field_name, value, f"use an integer >= {minimum}")


def _check_slurm_name(field_name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not _SLURM_NAME_RE.fullmatch(value):
        raise _fail(field_name, value, "use letters, digits, '.', '_' and '-' only")


def _check_directive_text(field_name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or _DIRECTIVE_BREAKERS_RE.search(value):
        raise _fail(
            field_name, value, "use a non-empty string without line breaks, control characters or backslashes"
        )


def _check_time_limit(value: object) -> None:
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return
    elif isinstance(value, str):
        match = _TIME_DHMS_RE.fullmatch(value) or _TIME_HMS_RE.fullmatch(value)
        if match is not None and any(int(part) for part in match.groups()):
            return
    raise _fail(
        "time_limit", value, "use whole minutes > 0 (e.g. 60) or 'HH:MM:SS' / 'D-HH:MM:SS' above zero"
    )


def _check_signal(value: object) -> None:
    if value is None:
        return
    match = _SIGNAL_RE.fullmatch(value) if isinstance(value, str) else None
    if (
        match is None
        or f"SIG{match.group('name')}" not in signal.Signals.__members__
        or int(match.group("seconds")) > _SIGNAL_MAX_SECONDS
    ):
        raise _fail(
            "signal",
            value,
            f"use '<signal name>@<seconds before the time limit>' such as 'USR2@90' (seconds <= "
            f"{_SIGNAL_MAX_SECONDS}; the 'B:' prefix is added when rendering)",
        )


@dataclass(frozen=True, kw_only=True)
class SlurmJobSpec:
    """Everything needed to render one batch script; validated on construction.

    :param job_name: Slurm job name, ``[A-Za-z0-9._-]`` up to 200 characters; see
        :func:`deterministic_job_name`.
    :param partition: partition to submit to.
    :param command: argv of the program to run; every element is shell-quoted, so it may hold any text.
    :param nodes: number of nodes (>= 1).
    :param gpus_per_node: GPUs per node (>= 0); rendered as ``--gres``.
    :param ranks_per_node: 0 runs the command as the batch shell itself (``exec``, one process). N >= 1
        starts it as one ``srun`` step of N tasks on each of the ``nodes`` nodes (the ranks of a distributed
        job), each task bound to one GPU when ``gpus_per_node`` > 0 (which must then equal N), and the whole
        step killed when any rank fails (``--kill-on-bad-exit=1``).
    :param gpu_type: GRES type such as ``"h200"``; needs ``gpus_per_node`` > 0.
    :param cpus_per_task: CPUs per task (>= 1).
    :param mem: memory per node such as ``"16G"`` (units K, M, G, T; none means megabytes).
    :param time_limit: whole minutes (int > 0) or ``"HH:MM:SS"`` / ``"D-HH:MM:SS"``; Slurm rounds up to
        whole minutes.
    :param account: Slurm account.
    :param qos: quality of service.
    :param constraint: node feature expression such as ``"h200&ib"``.
    :param signal: ``"<name>@<seconds>"`` such as ``"USR2@90"``: signal the command that many seconds before
        the time limit (rendered as ``B:USR2@90``, see :func:`render_sbatch_script`).
    :param requeue: allow Slurm to requeue the job after preemption or node failure.
    :param output: stdout path; Slurm patterns such as ``%x`` and ``%j`` are allowed.
    :param error: stderr path; defaults to ``output`` in Slurm when unset.
    :param workdir: working directory of the job (``--chdir``).
    :param comment: the job's comment (``--comment``), at most 1024 bytes; the suite's operators put the job's
        task instance there (:class:`hybridflow.utils.slurm_jobs.SlurmJobKey`) for the orphan reconciler.
    :param setup_lines: shell lines run before the command, verbatim and unquoted. They are trusted
        configuration read from ``include/`` (module loads, venv activation), never user input; each element
        is one line. They run under ``set -euo pipefail``.
    :param env: variables exported before the setup lines; names must be shell identifiers, values are quoted.
    :param node_check: argv of a self-check run once on every node before the command (one ``srun`` task per
        node holding the node's GPUs); a node that fails it ends the job with the check's exit code.
    :param exclude: nodes the job must not run on (``--exclude``), e.g. one that failed its self-check.
    :param end_marker_dir: a directory on the shared filesystem where the batch shell writes its end marker
        (:func:`end_marker_path`, holding the command's exit status) the moment the command ends, so a waiting task
        sees the end at once instead of at its next poll; the command then runs as the shell's child, with the
        signals the shell gets passed on (see :func:`render_sbatch_script`). None: no marker, ``exec`` as before.
    """

    job_name: str
    partition: str
    command: Sequence[str]
    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int = 0
    gpu_type: str | None = None
    cpus_per_task: int = 1
    mem: str | None = None
    time_limit: int | str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    signal: str | None = None
    requeue: bool = False
    output: str | None = None
    error: str | None = None
    workdir: str | None = None
    comment: str | None = None
    setup_lines: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    node_check: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    end_marker_dir: str | None = None

    def __post_init__(self) -> None:
        self._validate_names()
        self._validate_resources()
        for field_name in ("output", "error", "workdir", "comment", "end_marker_dir"):
            _check_directive_text(field_name, getattr(self, field_name))
        if self.comment is not None and len(self.comment.encode()) > JOB_COMMENT_MAX_BYTES:
            raise _fail("comment", self.comment, f"use at most {JOB_COMMENT_MAX_BYTES} bytes (slurmctld refuses more)")
        if not isinstance(self.requeue, bool):
            raise _fail("requeue", self.requeue, "use True or False")
        self._validate_script_body()

    def _validate_names(self) -> None:
        _check_slurm_name("job_name", self.job_name, optional=False)
        if len(self.job_name) > JOB_NAME_MAX_LENGTH:
            raise _fail(
                "job_name",
                self.job_name,
                f"use at most {JOB_NAME_MAX_LENGTH} characters (deterministic_job_name() shortens ids)",
            )
        _check_slurm_name("partition", self.partition, optional=False)
        _check_slurm_name("account", self.account, optional=True)
        _check_slurm_name("qos", self.qos, optional=True)
        _check_slurm_name("gpu_type", self.gpu_type, optional=True)
        if isinstance(self.exclude, str):
            raise _fail("exclude", self.exclude, "pass a list of node names")
        for node in self.exclude:
            _check_slurm_name("exclude", node, optional=False)
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.constraint is not None and (
            not isinstance(self.constraint, str) or not _CONSTRAINT_RE.fullmatch(self.constraint)
        ):
            raise _fail(
                "constraint", self.constraint, "use feature names joined by & | , with [ ] ( ) * ! only"
            )

    def _validate_resources(self) -> None:
        _check_int("nodes", self.nodes, 1)
        _check_int("gpus_per_node", self.gpus_per_node, 0)
        _check_int("ranks_per_node", self.ranks_per_node, 0)
        if self.ranks_per_node and self.gpus_per_node and self.ranks_per_node != self.gpus_per_node:
            raise _fail("ranks_per_node", self.ranks_per_node,
                        f"use one rank per GPU: ranks_per_node = gpus_per_node ({self.gpus_per_node})")
        _check_int("cpus_per_task", self.cpus_per_task, 1)
        if self.gpu_type is not None and self.gpus_per_node == 0:
            raise _fail("gpu_type", self.gpu_type, "set gpus_per_node > 0 as well, or leave gpu_type unset")
        if self.mem is not None and (not isinstance(self.mem, str) or not _MEM_RE.fullmatch(self.mem)):
            raise _fail(
                "mem", self.mem, "use a positive integer with an optional unit K, M, G or T, e.g. '16G'"
            )
        _check_time_limit(self.time_limit)
        _check_signal(self.signal)

    def _validate_script_body(self) -> None:
        if isinstance(self.command, str) or not isinstance(self.command, Sequence) or not self.command:
            raise _fail("command", self.command, "pass the argv as a non-empty list of strings")
        for element in self.command:
            if not isinstance(element, str) or "\x00" in element:
                raise _fail("command", self.command, "every argv element must be a string without NUL bytes")
        object.__setattr__(self, "command", tuple(self.command))
        if isinstance(self.node_check, str) or not all(
                isinstance(element, str) and "\x00" not in element for element in self.node_check):
            raise _fail("node_check", self.node_check, "pass the argv as a list of strings without NUL bytes")
        object.__setattr__(self, "node_check", tuple(self.node_check))

        if isinstance(self.setup_lines, str):
            raise _fail("setup_lines", self.setup_lines, "pass a tuple of lines, not one string")
        for line in self.setup_lines:
            if not isinstance(line, str) or re.search(r"[\r\n\x00]", line):
                raise _fail("setup_lines", self.setup_lines, "every element must be one line of text")
        object.__setattr__(self, "setup_lines", tuple(self.setup_lines))

        if not isinstance(self.env, Mapping):
            raise _fail("env", self.env, "pass a mapping of variable name to value")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
                raise _fail("env", self.env, f"variable name {name!r} must match [A-Za-z_][A-Za-z0-9_]*")
            if not isinstance(value, str) or "\x00" in value:
                raise _fail("env", self.env, f"value of {name} must be a string without NUL bytes")
        object.__setattr__(self, "env", dict(self.env))


def deterministic_job_name(dag_id: str, task_id: str, run_id: str, prefix: str = "hf") -> str:
    """A valid Slurm job name that is the same for the same task instance on every call and every retry.

    The readable part is the ids with every character outside ``[A-Za-z0-9._-]`` replaced by ``_`` (run ids
    hold ``:`` and ``+``), shortened to fit; the last 16 hex digits come from a sha256 of the raw ids, so
    ids that sanitise or truncate to the same text still get different names. Retries keep the name, which
    lets a retry find the job an earlier attempt submitted.
    """
    if not isinstance(prefix, str) or not _SLURM_NAME_RE.fullmatch(prefix):
        raise InvalidJobSpecError(
            f"Job name prefix {prefix!r} is invalid: use letters, digits, '.', '_' and '-' only"
        )
    digest = hashlib.sha256(json.dumps([dag_id, task_id, run_id]).encode()).hexdigest()
    # A Slurm name, not a path, so not layout.safe_segment: a change to path rules must never rename the jobs
    # that retries find by name.
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{prefix}-{dag_id}-{task_id}-{run_id}")
    readable = readable[: JOB_NAME_MAX_LENGTH - _JOB_NAME_DIGEST_LENGTH - 1]
    return f"{readable}-{digest[:_JOB_NAME_DIGEST_LENGTH]}"


def _sbatch_directives(spec: SlurmJobSpec) -> list[str]:
    gres = None
    if spec.gpus_per_node:
        gres = f"gpu:{spec.gpu_type}:{spec.gpus_per_node}" if spec.gpu_type else f"gpu:{spec.gpus_per_node}"
    options: list[tuple[str, str | None]] = [
        ("job-name", spec.job_name),
        ("partition", spec.partition),
        ("account", spec.account),
        ("qos", spec.qos),
        ("nodes", str(spec.nodes)),
        ("ntasks-per-node", str(spec.ranks_per_node) if spec.ranks_per_node else None),
        ("cpus-per-task", str(spec.cpus_per_task)),
        ("mem", spec.mem),
        ("gres", gres),
        ("constraint", spec.constraint),
        ("exclude", ",".join(spec.exclude) or None),
        ("time", None if spec.time_limit is None else str(spec.time_limit)),
        ("signal", None if spec.signal is None else f"{'' if spec.ranks_per_node else 'B:'}{spec.signal}"),
    ]
    lines = [f"#SBATCH --{flag}={shlex.quote(value)}" for flag, value in options if value is not None]
    lines.append("#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue")
    if spec.requeue:
        # A requeued job reopens its output files; Slurm's default truncates them, losing the first run's log.
        lines.append("#SBATCH --open-mode=append")
    paths = [("chdir", spec.workdir), ("output", spec.output), ("error", spec.error)]
    lines += [f"#SBATCH --{flag}={shlex.quote(value)}" for flag, value in paths if value is not None]
    if spec.comment is not None:
        lines.append(f"#SBATCH --comment={shlex.quote(spec.comment)}")
    return lines


def srun_argv(spec: SlurmJobSpec) -> list[str]:
    """The ``srun`` line that starts ``ranks_per_node`` ranks on every node of the allocation.

    ``--kill-on-bad-exit=1``: one rank dying (a crash, a SIGKILL) ends the whole step at once instead of
    leaving its peers blocked in a collective. ``--gpus-per-task=1`` with ``--gpu-bind=single:1`` gives each
    rank its own GPU (``CUDA_VISIBLE_DEVICES`` lists one id).
    """
    argv = ["srun", "--kill-on-bad-exit=1", f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.ranks_per_node}",
            f"--ntasks={spec.nodes * spec.ranks_per_node}", f"--cpus-per-task={spec.cpus_per_task}"]
    if spec.gpus_per_node:
        argv += ["--gpus-per-task=1", "--gpu-bind=single:1"]
    return [*argv, "--", *spec.command]


def node_check_argv(spec: SlurmJobSpec) -> list[str]:
    """The ``srun`` line of the node self-check: one task per node, holding that node's GPUs so it can count them;
    under ``set -e`` a failing node ends the job with the check's own exit code (srun returns the highest)."""
    argv = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1"]
    if spec.gpus_per_node:
        argv.append(f"--gres=gpu:{spec.gpus_per_node}")
    return [*argv, "--", *spec.node_check]


def render_sbatch_script(spec: SlurmJobSpec) -> str:
    """The complete batch script for ``spec``, to be passed to ``sbatch --parsable`` on stdin.

    Layout: shebang, one ``#SBATCH`` line per set option in a fixed order, ``set -euo pipefail``, ``umask``, the
    exports, the setup lines, then ``exec`` of the quoted command, or of the ``srun`` step that starts it
    once per rank (``ranks_per_node``).

    Signals before the time limit: a one-process job gets ``--signal=B:...``, which signals the batch shell;
    ``exec`` makes the command that process (without it bash takes the signal and dies: measured on 22.05.8,
    USR2 ended the job FAILED 0:12 and the child never saw it). A job of ranks gets ``--signal=...`` without
    ``B:``: Slurm then signals every task of the srun step, so every rank sees it, and not the batch shell.
    """
    # umask 0002: what a job writes in the shared storage stays writable by the storage group, which Airflow's
    # service user shares with the job user (it publishes, replaces and cleans up beside the jobs).
    lines = ["#!/bin/bash", *_sbatch_directives(spec), "set -euo pipefail", "umask 0002"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in spec.env.items()]
    lines += spec.setup_lines
    if spec.node_check:
        lines.append(shlex.join(node_check_argv(spec)))
    command = shlex.join(srun_argv(spec) if spec.ranks_per_node else spec.command)
    if spec.end_marker_dir is None:
        lines.append(f"exec {command}")
    else:
        lines += _RUN_AND_MARK_END.format(command=command, marker=end_marker_path(
            shlex.quote(spec.end_marker_dir), '"${SLURM_JOB_ID:-0}"', '"${SLURM_RESTART_COUNT:-0}"')).splitlines()
    return "\n".join(lines) + "\n"


# The command as the batch shell's child, so the shell can mark its end: the signals the shell gets (B:USR2 before
# the time limit, `scancel --batch`, TERM) are passed on, a signal that woke `wait` while the child runs is waited
# out, the marker holds the exit status, and a child killed by a signal kills the shell with the same signal, so
# accounting keeps <code>:<signal> as with exec. A background child ignores SIGINT (bash, no job control).
_RUN_AND_MARK_END = """\
{command} &
hf_child=$!
hf_pass_on() {{ kill -s "$1" "$hf_child" 2>/dev/null || true; }}
for hf_signal in TERM HUP USR1 USR2; do trap "hf_pass_on $hf_signal" "$hf_signal"; done
hf_status=0; wait "$hf_child" || hf_status=$?
while kill -0 "$hf_child" 2>/dev/null; do hf_status=0; wait "$hf_child" || hf_status=$?; done
if [ "$hf_status" -gt 128 ]; then
  hf_last=0; wait "$hf_child" 2>/dev/null || hf_last=$?; [ "$hf_last" -eq 127 ] || hf_status=$hf_last
fi
printf '%s\\n' "$hf_status" > {marker} || true
if [ "$hf_status" -gt 128 ] && hf_name=$(kill -l "$hf_status" 2>/dev/null); then
  trap - "$hf_name"; kill -s "$hf_name" "$$"
fi
exit "$hf_status"
"""


def end_marker_path(marker_dir: str, job_id: str, restart: str | int) -> str:
    """Where the batch shell of job ``job_id`` marks the end of its run number ``restart`` (Slurm's restart count:
    a requeued job runs again under the same id)."""
    return f"{marker_dir}/.ended-{job_id}-{restart}"


def wait_for_file_argv(path: str, window_s: float, every_s: float = 0.2) -> list[str]:
    """A command that returns as soon as ``path`` exists (exit 0) or after ``window_s`` (exit 1): file stats on the
    login node, no call to slurmctld."""
    tries = max(1, round(window_s / every_s))
    loop = 'n=$2; while [ "$n" -gt 0 ]; do [ -e "$1" ] && exit 0; sleep "$3"; n=$((n - 1)); done; [ -e "$1" ]'
    return ["sh", "-c", loop, "sh", path, str(tries), f"{every_s:g}"]


# --- Shared field parsers -----------------------------------------------------------------------------------

_DURATION_RE = re.compile(
    r"(?:(?P<days>\d+)-(?P<day_hours>\d+):|(?P<hours>\d+):)?(?P<minutes>\d+):(?P<seconds>\d+(?:\.\d+)?)"
)
_EXIT_CODE_RE = re.compile(r"(?P<code>\d+):(?P<signal>\d+)")


def _parse_duration(text: str) -> float:
    """Seconds in Slurm's ``[D-]HH:MM:SS``, ``H:MM:SS`` or ``MM:SS[.fff]`` notation."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None:
        raise SlurmOutputParseError(f"Not a Slurm duration: {text!r}")
    days = int(match.group("days") or 0)
    hours = int(match.group("day_hours") or match.group("hours") or 0)
    return ((days * 24 + hours) * 60 + int(match.group("minutes"))) * 60 + float(match.group("seconds"))


def _parse_exit_code(text: str) -> tuple[int, int]:
    match = _EXIT_CODE_RE.fullmatch(text.strip())
    if match is None:
        raise SlurmOutputParseError(f"Not a Slurm exit code '<code>:<signal>': {text!r}")
    return int(match.group("code")), int(match.group("signal"))


def _parse_int(text: str, what: str) -> int:
    if not re.fullmatch(r"[0-9]+", text.strip()):
        raise SlurmOutputParseError(f"{what} is not a whole number: {text!r}")
    return int(text)


def _parse_timestamp(text: str) -> datetime | None:
    if text in ("None", "Unknown"):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise SlurmOutputParseError(
            f"Not an ISO 8601 Slurm time: {text!r} (is SLURM_TIME_FORMAT set on the cluster?)"
        ) from None


def _split_fields(line: str, count: int, name_index: int) -> list[str]:
    """Split a ``|``-separated line; extra ``|`` are kept in the free-text name field at ``name_index``."""
    head = line.split("|", name_index)
    if len(head) <= name_index:
        raise SlurmOutputParseError(f"Expected {count} '|'-separated fields, got: {line!r}")
    tail = head.pop().rsplit("|", count - name_index - 1)
    if len(tail) != count - name_index:
        raise SlurmOutputParseError(f"Expected {count} '|'-separated fields, got: {line!r}")
    return head + tail


def _data_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.strip()]


# --- sbatch -------------------------------------------------------------------------------------------------

_SBATCH_PARSABLE_RE = re.compile(r"(?P<job_id>\d+)(?:;(?P<cluster>[A-Za-z0-9._-]+))?")


def parse_sbatch_parsable(stdout: str) -> str:
    """The job id from ``sbatch --parsable`` output: ``"123"`` or ``"123;cluster"`` (multi-cluster)."""
    match = _SBATCH_PARSABLE_RE.fullmatch(stdout.strip())
    if match is None:
        raise SlurmOutputParseError(
            f"sbatch --parsable printed {stdout!r}; expected '<job id>' or '<job id>;<cluster>'"
        )
    return match.group("job_id")


# --- GRES ---------------------------------------------------------------------------------------------------

_GRES_ITEM_RE = re.compile(
    r"(?P<name>[A-Za-z][A-Za-z0-9_]*)(?::(?P<middle>[^:()]+))?(?::(?P<count>[^:()]+))?(?:\((?P<detail>[^()]*)\))?"
)
_GRES_COUNT_RE = re.compile(r"(?P<number>\d+)(?P<unit>[KMGTP]?)")
_GRES_COUNT_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
_GRES_EMPTY = ("", "(null)", "N/A")


@dataclass(frozen=True)
class GresSpec:
    """One generic resource: ``gpu:h200:2(IDX:0-1)`` is name gpu, type h200, count 2, indices (0, 1).

    ``indices`` come only from ``IDX:`` (GresUsed); the socket affinity ``S:`` of a node's Gres is not kept.
    """

    name: str
    type: str | None
    count: int
    indices: tuple[int, ...] = ()


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: ``gpu:a:2(IDX:0,2),gpu:b:1`` has two items."""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    items.append(text[start:])
    return items


def _parse_index_list(text: str, source: str) -> tuple[int, ...]:
    if text == "N/A":
        return ()
    indices: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not re.fullmatch(r"[0-9]+", low) or (high and not re.fullmatch(r"[0-9]+", high)):
            raise SlurmOutputParseError(f"Bad GRES index list {text!r} in {source!r}")
        indices.extend(range(int(low), int(high or low) + 1))
    return tuple(indices)


def _parse_gres_count(text: str, source: str) -> int:
    match = _GRES_COUNT_RE.fullmatch(text)
    if match is None:
        raise SlurmOutputParseError(f"Bad GRES count {text!r} in {source!r}")
    return int(match.group("number")) * _GRES_COUNT_UNITS[match.group("unit")]


def parse_gres(text: str) -> tuple[GresSpec, ...]:
    """Parse a GRES list as sinfo, squeue and scontrol print it.

    Accepts ``gpu:h200:8``, ``gpu:8``, ``gpu`` (count 1), ``gpu:h200:8(S:0-1)``, ``gpu:h200:2(IDX:0-1)``,
    ``gpu:h200:0(IDX:N/A)``, comma-separated lists (commas inside parentheses belong to the item), and
    ``(null)``, ``N/A`` or an empty string for none.
    """
    source = text
    text = text.strip()
    if text in _GRES_EMPTY:
        return ()
    specs = []
    for item in _split_top_level(text):
        match = _GRES_ITEM_RE.fullmatch(item.strip())
        if match is None:
            raise SlurmOutputParseError(f"Bad GRES item {item!r} in {source!r}")
        middle, count = match.group("middle"), match.group("count")
        if count is None and middle is not None and _GRES_COUNT_RE.fullmatch(middle):
            middle, count = None, middle
        indices: tuple[int, ...] = ()
        detail = match.group("detail")
        if detail is not None and detail.startswith("IDX:"):
            indices = _parse_index_list(detail[len("IDX:") :], source)
        specs.append(
            GresSpec(
                name=match.group("name"),
                type=middle,
                count=1 if count is None else _parse_gres_count(count, source),
                indices=indices,
            )
        )
    return tuple(specs)


def gpu_count(gres: Iterable[GresSpec]) -> int:
    """Total count of the ``gpu`` resources in a parsed GRES list, over all types."""
    return sum(spec.count for spec in gres if spec.name == "gpu")


# --- sacct --------------------------------------------------------------------------------------------------

# sacct -X -P -n --format=<SACCT_FORMAT> -j <id>[,<id>...]   (-X: allocations only, no .batch steps;
# -P: '|'-separated without padding or truncation; -n: no header). Add -D to see every run of a requeued job.
# 22.05 has no Restarts field in sacct; scontrol show job has it while the job is still known to slurmctld.
SACCT_FORMAT = "JobID,JobName,State,ExitCode,Elapsed,AllocTRES,Start,End"
_SACCT_FIELD_COUNT = len(SACCT_FORMAT.split(","))


@dataclass(frozen=True)
class SacctRecord:
    """One line of ``sacct -X -P -n --format=SACCT_FORMAT``.

    ``exit_code`` and ``exit_signal`` come from ``ExitCode`` ``"<code>:<signal>"``; a TIMEOUT reads 0:0
    here (scontrol prints 0:15). ``alloc_tres`` is empty for a job that never started; ``start`` and
    ``end`` are None where sacct prints ``None`` or ``Unknown`` (not started, still running).
    """

    job_id: str
    job_name: str
    state: str
    cancelled_by: int | None
    exit_code: int
    exit_signal: int
    elapsed_seconds: float
    alloc_tres: Mapping[str, str] = field(hash=False)
    gpus: int
    start: datetime | None
    end: datetime | None


def _parse_tres(text: str, source: str) -> dict[str, str]:
    tres: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SlurmOutputParseError(f"Bad TRES item {item!r} in {source!r}")
        tres[key] = value
    return tres


def _gpus_from_tres(tres: Mapping[str, str], source: str) -> int:
    # Typed counts (gres/gpu:h200=1) appear only when AccountingStorageTRES lists the type; they are a
    # breakdown of the untyped total, so they count only when the total is missing.
    if "gres/gpu" in tres:
        return _parse_int(tres["gres/gpu"], f"gres/gpu in {source!r}")
    return sum(
        _parse_int(value, f"{key} in {source!r}")
        for key, value in tres.items()
        if key.startswith("gres/gpu:")
    )


def parse_sacct(stdout: str) -> list[SacctRecord]:
    """Records in output order, one per line of ``sacct -X -P -n --format=SACCT_FORMAT``.

    With ``-D`` a requeued job has one line per run; see :func:`latest_by_job_id`.
    """
    records = []
    for line in _data_lines(stdout):
        job_id, job_name, state, exit_code, elapsed, tres_text, start, end = _split_fields(
            line, _SACCT_FIELD_COUNT, name_index=1
        )
        if "." in job_id:
            raise SlurmOutputParseError(f"Job step line in sacct output (run sacct with -X): {line!r}")
        base_state, cancelled_by = normalise_state(state)
        code, exit_signal = _parse_exit_code(exit_code)
        tres = _parse_tres(tres_text, line)
        records.append(
            SacctRecord(
                job_id=job_id,
                job_name=job_name,
                state=base_state,
                cancelled_by=cancelled_by,
                exit_code=code,
                exit_signal=exit_signal,
                elapsed_seconds=_parse_duration(elapsed),
                alloc_tres=tres,
                gpus=_gpus_from_tres(tres, line),
                start=_parse_timestamp(start),
                end=_parse_timestamp(end),
            )
        )
    return records


def latest_by_job_id(records: Iterable[SacctRecord]) -> dict[str, SacctRecord]:
    """The latest record of each job id.

    ``sacct -D`` prints every run of a requeued job oldest first (measured on 22.05.8: REQUEUED, then
    NODE_FAIL, then PENDING for the run now queued), so the last line of a job id wins.
    """
    latest: dict[str, SacctRecord] = {}
    for record in records:
        latest[record.job_id] = record
    return latest


# --- squeue -------------------------------------------------------------------------------------------------

# squeue --noheader -o <SQUEUE_FORMAT> -j <id>[,<id>...]
# Job id | name | state (long) | reason | tres-per-node | nodes | time used. %b prints what the job asked
# per node ("gres:gpu:h200:2", "gres:gpu:1", "N/A"); a per-job request (--gpus=2) shows as N/A.
SQUEUE_FORMAT = "%i|%j|%T|%r|%b|%D|%M"
_SQUEUE_FIELD_COUNT = SQUEUE_FORMAT.count("|") + 1


@dataclass(frozen=True)
class SqueueRecord:
    """One line of ``squeue --noheader -o SQUEUE_FORMAT``; ``gres`` is the raw %b text."""

    job_id: str
    name: str
    state: str
    reason: str
    gres: str
    gpus_per_node: int
    nodes: int
    elapsed_seconds: float


def parse_squeue(stdout: str) -> list[SqueueRecord]:
    """Records in output order, one per line of ``squeue --noheader -o SQUEUE_FORMAT``."""
    records = []
    for line in _data_lines(stdout):
        job_id, name, state, reason, gres, nodes, elapsed = _split_fields(
            line, _SQUEUE_FIELD_COUNT, name_index=1
        )
        base_state, _ = normalise_state(state)
        per_node = re.sub(r"(^|,)gres[:/]", r"\1", gres.strip())
        records.append(
            SqueueRecord(
                job_id=job_id,
                name=name,
                state=base_state,
                reason=reason,
                gres=gres,
                gpus_per_node=gpu_count(parse_gres(per_node)),
                nodes=_parse_int(nodes, f"node count in {line!r}"),
                elapsed_seconds=_parse_duration(elapsed),
            )
        )
    return records


# --- scontrol show job --------------------------------------------------------------------------------------

# scontrol show job <id>  (the multi-line form). These keys are printed alone on their line and their value
# runs to the end of it, spaces included.
_SCONTROL_LINE_KEYS = frozenset(
    {"Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment", "AdminComment", "SystemComment"}
)
_SCONTROL_KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9_:/]*")


def parse_scontrol_show_job(stdout: str) -> dict[str, str]:
    """The ``Key=Value`` fields of ``scontrol show job <id>`` for one job.

    Values are split on whitespace; a word without ``=`` continues the previous value (a job name or reason
    with spaces). The keys in ``_SCONTROL_LINE_KEYS`` take the rest of their line (paths with spaces).
    Also reads the one-line form (``scontrol -o``) with the same rules.
    """
    fields: dict[str, str] = {}
    current: str | None = None
    for line in _data_lines(stdout):
        stripped = line.strip()
        key, sep, value = stripped.partition("=")
        if sep and key in _SCONTROL_LINE_KEYS:
            fields[key] = value
            current = None
            continue
        for word in stripped.split():
            key, sep, value = word.partition("=")
            if sep and _SCONTROL_KEY_RE.fullmatch(key):
                if key == "JobId" and "JobId" in fields:
                    raise SlurmOutputParseError(f"Expected one job, got several: {stdout!r}")
                fields[key] = value
                current = key
            elif current is not None:
                fields[current] += f" {word}"
            else:
                raise SlurmOutputParseError(f"Unexpected word {word!r} in scontrol output: {stdout!r}")
    if "JobId" not in fields:
        raise SlurmOutputParseError(f"No JobId in scontrol show job output: {stdout!r}")
    return fields


def _scontrol_field(fields: Mapping[str, str], key: str) -> str:
    if key not in fields:
        raise SlurmOutputParseError(f"scontrol show job output has no {key}: {dict(fields)!r}")
    return fields[key]


def scontrol_job_state(fields: Mapping[str, str]) -> str:
    """``JobState`` of parsed ``scontrol show job`` fields, e.g. ``"RUNNING"``."""
    return normalise_state(_scontrol_field(fields, "JobState"))[0]


def scontrol_restarts(fields: Mapping[str, str]) -> int:
    """``Restarts``: how often the job was requeued."""
    return _parse_int(_scontrol_field(fields, "Restarts"), "Restarts")


def scontrol_exit_code(fields: Mapping[str, str]) -> tuple[int, int]:
    """``ExitCode`` as ``(code, signal)``; a TIMEOUT reads ``(0, 15)`` here."""
    return _parse_exit_code(_scontrol_field(fields, "ExitCode"))


# --- sinfo --------------------------------------------------------------------------------------------------

# sinfo -N -h -p <partition> -O <SINFO_GPU_FORMAT>
# In -O, "Field:|" means no width and "|" as suffix: the value is printed whole, unpadded, followed by "|"
# (measured; a field without a width is padded and cut at 20 characters). Lines therefore end with "|".
# -N prints one line per node and partition, so pass -p to get each node once.
SINFO_GPU_FORMAT = "NodeList:|,StateLong:|,Gres:|,GresUsed:|"
_SINFO_FIELD_COUNT = SINFO_GPU_FORMAT.count(",") + 1

# Node states that take new work once resources free up. StateLong is lower case; a trailing character
# flags the node (sinfo(1) NODE STATE CODES): "+" more jobs completing, "-" planned by backfill, both
# harmless; "*" not responding, "~" powered off, "#" powering up, "!" / "%" powering down, "$" maintenance,
# "@" / "^" reboot pending / issued, all of which make the node unavailable now.
SCHEDULABLE_NODE_STATES = ("idle", "mixed", "allocated", "completing")
_NODE_STATE_RE = re.compile(r"(?P<state>[a-z_]+)(?P<flags>[*~#!%$@^+-]*)")
_HARMLESS_NODE_FLAGS = frozenset("+-")


@dataclass(frozen=True)
class SinfoNode:
    """One node of ``sinfo -N -h -p <partition> -O SINFO_GPU_FORMAT``.

    ``state`` is StateLong without its flag characters (``"down"`` for ``"down*"``), ``flags`` the
    characters removed, ``available`` whether the node can take new work without an admin or a power
    action.
    """

    name: str
    state: str
    flags: frozenset[str]
    available: bool
    gpus_total: int
    gpus_used: int

    @property
    def gpus_free(self) -> int:
        """GPUs a new job could get on this node now; 0 when the node is not available."""
        return max(self.gpus_total - self.gpus_used, 0) if self.available else 0


def parse_sinfo_gpus(stdout: str) -> list[SinfoNode]:
    """Nodes in output order from ``sinfo -N -h -p <partition> -O SINFO_GPU_FORMAT``."""
    nodes = []
    for line in _data_lines(stdout):
        text = line.strip()
        if not text.endswith("|"):
            raise SlurmOutputParseError(
                f"sinfo line does not end with the '|' suffix of the last field: {line!r}"
            )
        parts = text[:-1].split("|")
        if len(parts) != _SINFO_FIELD_COUNT:
            raise SlurmOutputParseError(f"Expected {_SINFO_FIELD_COUNT} '|'-separated fields, got: {line!r}")
        name, state_text, gres, gres_used = parts
        match = _NODE_STATE_RE.fullmatch(state_text.lower())
        if not name or match is None:
            raise SlurmOutputParseError(f"Bad node name or state in sinfo line: {line!r}")
        flags = frozenset(match.group("flags"))
        nodes.append(
            SinfoNode(
                name=name,
                state=match.group("state"),
                flags=flags,
                available=match.group("state") in SCHEDULABLE_NODE_STATES and flags <= _HARMLESS_NODE_FLAGS,
                gpus_total=gpu_count(parse_gres(gres)),
                gpus_used=gpu_count(parse_gres(gres_used)),
            )
        )
    return nodes
