"""Pure pieces of the stall watch: read the ranks' heartbeats, decide whether a job stalled and which ranks stopped
it, and the commands and text around it (the job side writes the heartbeats: jobs/hybridtrain/heartbeat.py).

Each rank has a progress deadline of its own (:meth:`StallWatch.deadline`): while it trains, past its warm-up, ``max(
stall_floor_s, stall_factor x its median step time)`` (the way nvidia-resiliency-ext derives heartbeat timeouts
from observed steps), never above ``stall_timeout_s``; in every other phase (start-up, data load, rendezvous,
checkpoint reads and writes, evaluation) and before warm-up, ``stall_timeout_s``. A job has stalled when every rank
is past its deadline (the ranks of a data-parallel job wait on one another, so one hung rank soon holds them all),
or when one rank's heartbeat thread, which writes every ``heartbeat_every_s`` whatever the rank does, has been
silent for ``max(stall_floor_s, 3 x heartbeat_every_s)``: that process stopped (a SIGSTOP, a frozen node), in any
phase. A rank alone in a long pause (rank 0 hashing a checkpoint for its manifest while the others wait in a
collective) is not a stall: its thread writes on, and it is within its own deadline.

The ranks to blame: those whose heartbeat thread fell silent too, or that never reported; else those behind the
others (the others wait on them in a collective); else every rank (all stuck alike: a shared filesystem).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from hybridflow.exceptions import InvalidJobSpecError

STACK_FRAMES = 12  # frames of each stopped rank's stack kept in the report and the alert
TRAINING_PHASE = "training"  # the job's phase of training steps (jobs/hybridtrain/runner.py)
ENDED_PHASES = ("exited", "failed")  # a rank that ended stops writing: its silence is no stall
SILENT_BEATS = 3  # heartbeat periods a living rank's thread never misses
# The watch's settings, each with its bounds: pipeline.yaml's recovery section and a nightly run's params keep to them.
STALL_SETTINGS: dict[str, tuple[float, float]] = {
    "stall_timeout_s": (10, 86_400),
    "stall_floor_s": (10, 3_600),  # two heartbeat periods (heartbeat_every_s, 5 s) at least
    "stall_factor": (2, 1_000),
    "stall_warm_up_steps": (1, 10_000),
}
# What the watch needs between a stall and the collective timeout: a check, a heartbeat period, the stacks (py-spy,
# 90 s at most) and the requeue. A collective timeout that fired first would fail the job unnamed.
COLLECTIVE_MARGIN_S = 180.0
_FRAME_RE = re.compile(r"\s+(?P<func>.+) \((?P<path>/.+):(?P<line>\d+)\)$")
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB_RE = re.compile(r"/usr(/local)?/lib(64)?/python3[.0-9]*/")

# One command, no user text in the script: the login node's clock (epoch seconds), then every heartbeat file.
_READ_SCRIPT = 'date +%s.%N; for f in "$1"/rank*.json; do [ -f "$f" ] && cat -- "$f" && echo; done; exit 0'


@dataclass(frozen=True)
class RankBeat:
    """One rank's last heartbeat (epoch seconds on its node's clock); ``step_s``: its last training steps' seconds,
    of ``steps_timed`` it timed in this attempt; ``every_s``: its thread's period."""

    rank: int
    node: str
    pid: int
    job_id: str
    restart: int
    phase: str
    step: int
    progress_at: float
    time: float
    step_s: tuple[float, ...] = ()
    steps_timed: int = 0
    every_s: float = 0.0


@dataclass(frozen=True)
class Deadline:
    """How long a rank may go without progress, and why (``basis``, for the stall's text)."""

    seconds: float
    basis: str


@dataclass(frozen=True)
class StallWatch:
    """The watch's settings (pipeline.yaml ``recovery``; a nightly run's params may override them)."""

    timeout_s: float
    floor_s: float
    factor: float
    warm_up_steps: int

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> StallWatch | None:
        """The watch from an operator's fields (:data:`STALL_SETTINGS` names): numbers, or a rendered template's
        text (``"{{ params.stall_floor_s }}"`` renders ``"30.0"``); None when ``stall_timeout_s`` is 0 (off). A value
        out of bounds names its field."""
        values = {}
        for name, (low, high) in STALL_SETTINGS.items():
            raw = settings[name]
            try:
                value = float(raw) if isinstance(raw, int | float | str) and not isinstance(raw, bool) else None
            except ValueError:
                value = None
            if name == "stall_timeout_s" and value == 0:
                return None
            integral = name == "stall_warm_up_steps"
            if value is None or not low <= value <= high or (integral and not value.is_integer()):
                raise InvalidJobSpecError(f"{name}={raw!r} is invalid: use a{' whole' if integral else ''} number from "
                                          f"{low:g} to {high:g}")
            values[name] = int(value) if integral else value
        return cls(timeout_s=values["stall_timeout_s"], floor_s=values["stall_floor_s"],
                   factor=values["stall_factor"], warm_up_steps=values["stall_warm_up_steps"])

    @property
    def check_every_s(self) -> float:
        """How often the trigger reads the heartbeats: a quarter of the shortest deadline, at most 30 s."""
        return min(min(self.floor_s, self.timeout_s) / 4, 30.0)

    @property
    def collective_timeout_s(self) -> float:
        """The job's collective timeout (every backend): above the longest deadline, so the watch names the rank."""
        return self.timeout_s + COLLECTIVE_MARGIN_S

    def deadline(self, beat: RankBeat) -> Deadline:
        """The rank's deadline: from its own median step while it trains past warm-up, else ``stall_timeout_s``.
        The median leaves out the attempt's first ``warm_up_steps`` steps (compilation, first collectives)."""
        longest = f"stall_timeout_s={self.timeout_s:g}"
        if beat.phase != TRAINING_PHASE:
            return Deadline(self.timeout_s, f"{longest} (phase {beat.phase})")
        before_window = beat.steps_timed - len(beat.step_s)
        sample = beat.step_s[max(0, self.warm_up_steps - before_window):]
        if beat.steps_timed <= self.warm_up_steps or not sample:
            return Deadline(self.timeout_s, f"{longest} (warming up: {beat.steps_timed} of stall_warm_up_steps="
                                            f"{self.warm_up_steps} steps timed)")
        median = statistics.median(sample)
        seconds = min(self.timeout_s, max(self.floor_s, self.factor * median))
        return Deadline(seconds, f"max(stall_floor_s={self.floor_s:g}, stall_factor={self.factor:g} x median step "
                                 f"{median:.3g} s over {len(sample)} steps), at most {longest}")

    def silence(self, beat: RankBeat) -> Deadline:
        """How long the rank's heartbeat thread may be silent before its process counts as stopped."""
        seconds = min(self.timeout_s, max(self.floor_s, SILENT_BEATS * beat.every_s))
        return Deadline(seconds, f"max(stall_floor_s={self.floor_s:g}, {SILENT_BEATS} x heartbeat_every_s="
                                 f"{beat.every_s:g})")


@dataclass(frozen=True)
class StoppedRank:
    rank: int
    node: str
    pid: int | None
    step: int | None
    phase: str
    why: str
    late_s: float
    deadline_s: float
    deadline: str

    @property
    def place(self) -> str:
        return f"rank {self.rank}@{self.node or '?'}"


@dataclass(frozen=True)
class Stall:
    """A job none of whose ranks progressed for ``silent_s`` seconds or one of whose processes stopped, past their
    deadlines, and the ranks that stopped it."""

    job_id: str
    silent_s: float
    ranks: tuple[StoppedRank, ...]

    def to_event(self) -> dict:
        return {"job_id": self.job_id, "silent_s": round(self.silent_s, 1),
                "ranks": [asdict(rank) for rank in self.ranks]}

    @classmethod
    def from_event(cls, event: Mapping) -> Stall:
        return cls(job_id=str(event["job_id"]), silent_s=float(event["silent_s"]),
                   ranks=tuple(StoppedRank(**rank) for rank in event["ranks"]))

    def summary(self) -> str:
        """``no rank progressed for 34 s; stopped: rank 1@gpu-node-02 (pid 812, step 50 at its last heartbeat,
        training; no progress for 36 s, deadline 30 s = max(stall_floor_s=30, stall_factor=10 x median step 0.012 s
        over 27 steps), at most stall_timeout_s=900; its heartbeat is silent too ...)``. The step and phase are as
        the rank's last heartbeat wrote them (``heartbeat_every_s`` before it stopped at most); the stack is now's."""
        ranks = "; ".join(f"{r.place} (pid {r.pid if r.pid is not None else '?'}, step "
                          f"{r.step if r.step is not None else '?'} at its last heartbeat, {r.phase}; no progress for "
                          f"{r.late_s:.0f} s, deadline {r.deadline_s:.0f} s = {r.deadline}; {r.why})"
                          for r in self.ranks)
        return f"no rank progressed for {self.silent_s:.0f} s; stopped: {ranks}"


def read_heartbeats_argv(heartbeat_dir: str) -> list[str]:
    """The login node's clock and every rank's heartbeat, in one SSH command (the directory is an argument)."""
    return ["sh", "-c", _READ_SCRIPT, "sh", heartbeat_dir]


def parse_heartbeats(stdout: str) -> tuple[float | None, list[RankBeat]]:
    """``(the cluster's clock, heartbeats)`` from :func:`read_heartbeats_argv`'s output; malformed files are
    skipped (a rank whose file cannot be read counts as not reporting)."""
    first, _, rest = stdout.partition("\n")
    try:
        now = float(first.strip())
    except ValueError:
        return None, []
    beats, decoder, position = [], json.JSONDecoder(), 0
    text = rest.strip()
    while position < len(text):
        try:
            data, end = decoder.raw_decode(text, position)
        except ValueError:
            break
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
        beat = _beat(data)
        if beat is not None:
            beats.append(beat)
    return now, beats


def _beat(data: object) -> RankBeat | None:
    if not isinstance(data, dict):
        return None
    try:
        return RankBeat(rank=int(data["rank"]), node=str(data["node"]), pid=int(data["pid"]),
                        job_id=str(data["job_id"]), restart=int(data["restart"]), phase=str(data["phase"]),
                        step=int(data["step"]), progress_at=float(data["progress_at"]), time=float(data["time"]),
                        step_s=tuple(float(s) for s in data.get("step_s") or ()),
                        steps_timed=int(data.get("steps_timed") or 0), every_s=float(data.get("every_s") or 0))
    except (KeyError, TypeError, ValueError):
        return None


def find_stall(beats: Iterable[RankBeat], *, now: float, job_id: str, restarts: int, running_s: float,
               world_size: int, watch: StallWatch) -> Stall | None:
    """The stall of job ``job_id`` (attempt ``restarts``, running for ``running_s``), or None while it progresses.

    Only heartbeats of this job and attempt count: a requeued job's files still hold the last attempt's. A rank that
    never reported has ``stall_timeout_s`` from the attempt's start.
    """
    current = {b.rank: b for b in beats if b.job_id == job_id and b.restart == restarts}
    started_at = now - running_s
    missing = Deadline(watch.timeout_s, f"stall_timeout_s={watch.timeout_s:g} (no heartbeat in this attempt)")
    deadlines = {rank: watch.deadline(beat) for rank, beat in current.items()}
    late = {rank: now - max(beat.progress_at, started_at) for rank, beat in current.items()}
    overdue = {rank for rank in current if late[rank] >= deadlines[rank].seconds}
    silences = {rank: watch.silence(beat) for rank, beat in current.items()}
    silent = {rank for rank, beat in current.items()
              if now - beat.time >= silences[rank].seconds and beat.phase not in ENDED_PHASES}
    absent = [rank for rank in range(world_size) if rank not in current]
    every_rank_overdue = len(overdue) == len(current) and (not absent or running_s >= watch.timeout_s)
    if not (every_rank_overdue or silent):
        return None

    def stopped(beat: RankBeat, why: str) -> StoppedRank:
        deadline = deadlines[beat.rank]
        return StoppedRank(beat.rank, beat.node, beat.pid, beat.step, beat.phase, why, late[beat.rank],
                           deadline.seconds, deadline.basis)

    blamed = [StoppedRank(rank, "", None, None, "not started", "no heartbeat from it in this attempt", running_s,
                          missing.seconds, missing.basis) for rank in absent if running_s >= watch.timeout_s]
    blamed += [stopped(current[rank], f"its heartbeat is silent too (last {now - current[rank].time:.0f} s ago, "
                                      f"over {silences[rank].seconds:.0f} s = {silences[rank].basis}): the process "
                                      "stopped") for rank in sorted(silent)]
    if not blamed and current:
        lowest = min(b.step for b in current.values())
        behind = [b for b in current.values() if b.step == lowest]
        why = ("behind the others (they wait on it)" if len(behind) < len(current)
               else "alive but not progressing, like every rank")
        blamed = [stopped(b, why) for b in behind]
    silent_s = now - max([started_at, *(b.progress_at for b in current.values())])
    return Stall(job_id=job_id, silent_s=silent_s, ranks=tuple(sorted(blamed, key=lambda r: r.rank)))


def py_spy_argv(py_spy: str, job_id: str, rank: StoppedRank) -> list[str]:
    """Dump a rank's Python stacks on its node, as a step beside the job's (``--overlap``, no GRES), without
    stopping it (``--nonblocking``: works on a stopped process, where ptrace's own stop would fail). Full file
    names: py-spy's short ones drop the directory of a module outside a package (``runner.py``)."""
    return ["timeout", "60", "srun", "--overlap", f"--jobid={job_id}", f"--nodelist={rank.node}", "--nodes=1",
            "--ntasks=1", "--gres=none", "--", py_spy, "dump", "--pid", str(rank.pid), "--nonblocking",
            "--full-filenames"]


def _frame(line: str) -> tuple[str, bool]:
    """A ``py-spy dump --full-filenames`` frame line, shortened (libraries from their package, the job's own code
    to its last two path parts), and whether it is the job's own code (not the standard library, not a package)."""
    match = _FRAME_RE.match(line)
    if match is None:
        return line, False
    path = match.group("path")
    for marker in _LIBRARY_MARKERS:
        if marker in path:
            return f"    {match.group('func')} ({path.split(marker, 1)[1]}:{match.group('line')})", False
    if _STDLIB_RE.match(path):
        return f"    {match.group('func')} ({path.rsplit('/', 1)[-1]}:{match.group('line')})", False
    short = "/".join(path.split("/")[-2:])
    return f"    {match.group('func')} ({short}:{match.group('line')})", True


def top_frames(dump: str, frames: int = STACK_FRAMES) -> str:
    """The first thread of a ``py-spy dump`` (the main thread comes first, innermost frame first): its innermost
    ``frames // 2`` frames, then the innermost frames of the job's own code, so the reader sees both where the
    process sits (a collective, a read) and which line of the job got it there."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Thread ")), None)
    if start is None:
        return dump.strip()[:2000]
    stack = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        stack.append(_frame(line))
    inner = [text for text, _ in stack[: frames // 2]]
    tail = [text for text, own in stack[frames // 2:] if own][: frames - len(inner)]
    skipped = len(stack) - len(inner) - len(tail)
    middle = [f"    ... {skipped} more frame(s) ..."] if skipped else []
    return "\n".join([lines[start], *inner, *middle, *tail])


def stall_report(stall: Stall, stacks: Mapping[int, str], action: str) -> str:
    """The text written into the job's log and the alert: the summary, what was done, each stopped rank's stack."""
    lines = [f"STALL of Slurm job {stall.job_id}: {stall.summary()}", f"action: {action}"]
    for rank in stall.ranks:
        lines.append(f"--- Python stack of {rank.place} (pid {rank.pid}) ---")
        lines.append(stacks.get(rank.rank, "(not captured)"))
    return "\n".join(lines)


def stall_count(records: Sequence[Mapping], job_id: str) -> int:
    """How many stalls of ``job_id`` the recovery log holds."""
    return sum(1 for r in records if r.get("kind") == "stall" and str(r.get("job_id")) == job_id)
