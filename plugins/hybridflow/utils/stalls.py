"""Pure pieces of the stall watch: read the ranks' heartbeats, decide whether a job stalled and which ranks stopped
it, and the commands and text around it (the job side writes the heartbeats: jobs/hybridtrain/heartbeat.py).

A stall: no rank made progress (a step, an evaluation chunk, a phase change) for ``stall_timeout_s``, counted
from the attempt's start while no rank has reported yet. The ranks to blame: those whose heartbeat thread fell
silent too (the process stopped: a SIGSTOP, a frozen node) or that never reported; else those behind the others
(the others wait on them in a collective); else every rank (all stuck alike: a shared filesystem).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

STACK_FRAMES = 12  # frames of each stopped rank's stack kept in the report and the alert
_FRAME_RE = re.compile(r"\s+(?P<func>.+) \((?P<path>/.+):(?P<line>\d+)\)$")
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB_RE = re.compile(r"/usr(/local)?/lib(64)?/python3[.0-9]*/")

# One command, no user text in the script: the login node's clock (epoch seconds), then every heartbeat file.
_READ_SCRIPT = 'date +%s.%N; for f in "$1"/rank*.json; do [ -f "$f" ] && cat -- "$f" && echo; done; exit 0'


@dataclass(frozen=True)
class RankBeat:
    """One rank's last heartbeat (epoch seconds on its node's clock)."""

    rank: int
    node: str
    pid: int
    job_id: str
    restart: int
    phase: str
    step: int
    progress_at: float
    time: float


@dataclass(frozen=True)
class StoppedRank:
    rank: int
    node: str
    pid: int | None
    step: int | None
    phase: str
    why: str

    @property
    def place(self) -> str:
        return f"rank {self.rank}@{self.node or '?'}"


@dataclass(frozen=True)
class Stall:
    """A job that made no progress for ``silent_s`` seconds (over ``timeout_s``), and the ranks that stopped it."""

    job_id: str
    silent_s: float
    timeout_s: float
    ranks: tuple[StoppedRank, ...]

    def to_event(self) -> dict:
        return {"job_id": self.job_id, "silent_s": round(self.silent_s, 1), "timeout_s": self.timeout_s,
                "ranks": [asdict(rank) for rank in self.ranks]}

    @classmethod
    def from_event(cls, event: Mapping) -> Stall:
        return cls(job_id=str(event["job_id"]), silent_s=float(event["silent_s"]), timeout_s=float(event["timeout_s"]),
                   ranks=tuple(StoppedRank(**rank) for rank in event["ranks"]))

    def summary(self) -> str:
        """``no rank progressed for 41 s (stall_timeout_s=30); stopped: rank 1@gpu-node-02 (pid 812, step 40,
        training; its heartbeat is silent too)``."""
        ranks = "; ".join(f"{r.place} (pid {r.pid if r.pid is not None else '?'}, step "
                          f"{r.step if r.step is not None else '?'}, {r.phase}; {r.why})" for r in self.ranks)
        return (f"no rank progressed for {self.silent_s:.0f} s (stall_timeout_s={self.timeout_s:g}); "
                f"stopped: {ranks}")


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
                        step=int(data["step"]), progress_at=float(data["progress_at"]), time=float(data["time"]))
    except (KeyError, TypeError, ValueError):
        return None


def find_stall(beats: Iterable[RankBeat], *, now: float, job_id: str, restarts: int, running_s: float,
               world_size: int, timeout_s: float) -> Stall | None:
    """The stall of job ``job_id`` (attempt ``restarts``, running for ``running_s``), or None while it progresses.

    Only heartbeats of this job and attempt count: a requeued job's files still hold the last attempt's.
    """
    current = {b.rank: b for b in beats if b.job_id == job_id and b.restart == restarts}
    started_at = now - running_s
    last_progress = max((b.progress_at for b in current.values()), default=started_at)
    silent_s = now - max(last_progress, started_at)
    if silent_s < timeout_s:
        return None
    stopped = [StoppedRank(r, "", None, None, "not started", "no heartbeat from it in this attempt")
               for r in range(world_size) if r not in current]
    stopped += [StoppedRank(b.rank, b.node, b.pid, b.step, b.phase,
                            f"its heartbeat is silent too (last {now - b.time:.0f} s ago): the process stopped")
                for b in current.values() if now - b.time >= timeout_s]
    if not stopped and current:
        lowest = min(b.step for b in current.values())
        behind = [b for b in current.values() if b.step == lowest]
        why = ("behind the others (they wait on it)" if len(behind) < len(current)
               else "alive but not progressing, like every rank")
        stopped = [StoppedRank(b.rank, b.node, b.pid, b.step, b.phase, why) for b in behind]
    return Stall(job_id=job_id, silent_s=silent_s, timeout_s=timeout_s,
                 ranks=tuple(sorted(stopped, key=lambda r: r.rank)))


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
