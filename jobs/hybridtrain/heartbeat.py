"""``<run_dir>/heartbeats/rank<r>.json``: each rank's sign of life and of progress, for the stall watch.

A thread rewrites the file every ``every_s`` seconds (atomically) with the rank's place (rank, node, pid, Slurm
job and restart), its phase and step, and two clocks (epoch seconds): ``progress_at``, when the rank last
made progress (the training loop calls :meth:`Heartbeat.beat` at every step, evaluation chunk and phase
change), and ``time``, when the thread wrote. The orchestrator reads both (plugins' ``utils/stalls.py``):
``progress_at`` old on every rank is a stall; ``time`` old on one rank means that process stopped altogether (a
SIGSTOP, a frozen node), while a rank whose thread still writes is alive but waiting (for a peer, on I/O).
``step_s`` (the last :data:`STEP_WINDOW` training steps' durations) and ``steps_timed`` (how many steps this
process timed) let the watch give each rank a deadline from its own step time; ``every_s``, how long the thread's
silence may last before it means a stopped process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from hybridjobs.layout import HEARTBEATS_DIR
from hybridtrain.checkpoints import write_json_atomic
from hybridtrain.time_split import PhaseClock

__all__ = ["STEP_WINDOW", "Heartbeat", "heartbeat_file"]

STEP_WINDOW = 32  # the recent step durations a heartbeat carries


def heartbeat_file(run_dir: Path, rank: int) -> Path:
    return run_dir / HEARTBEATS_DIR / f"rank{rank}.json"


class Heartbeat:
    """One rank's heartbeat file, written by a daemon thread; :meth:`beat` records progress (cheap: no I/O)."""

    def __init__(self, run_dir: Path, *, rank: int, node: str, environ: Mapping[str, str], every_s: float,
                 clock=time.time) -> None:
        self._path = heartbeat_file(run_dir, rank)
        self._every_s = every_s
        self._clock = clock
        restart = environ.get("SLURM_RESTART_COUNT", "0")
        self._place = {"rank": rank, "node": node, "pid": os.getpid(), "job_id": environ.get("SLURM_JOB_ID", ""),
                       "restart": int(restart) if restart.isdigit() else 0}
        self._phase, self._step, self._progress_at = "starting", 0, clock()
        # a tuple replaced whole: the writer thread reads it while the loop appends
        self._step_s: tuple[float, ...] = ()
        self._steps_timed = 0
        self.phases = PhaseClock(self._phase)  # wall time per phase (time_split); monotonic, unlike the beat's clock
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, *, step: int | None = None, phase: str | None = None) -> None:
        now = self._clock()
        if phase is None and self._phase == "training" and step == self._step + 1:
            # a step's duration: since the last step, or since training resumed after a checkpoint
            self._step_s = (*self._step_s[1 - STEP_WINDOW:], round(now - self._progress_at, 4))
            self._steps_timed += 1
        if step is not None:
            self._step = step
        if phase is not None:
            self.phases.enter(phase)
            self._phase = phase
        self._progress_at = now

    def start(self) -> Heartbeat:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, phase: str) -> None:
        """Stop the thread and write the last beat (``phase``: ``exited`` or ``failed``)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.beat(phase=phase)
        self.write()

    def write(self) -> None:
        try:
            write_json_atomic(self._path, {**self._place, "phase": self._phase, "step": self._step,
                                           "progress_at": round(self._progress_at, 3), "time": round(self._clock(), 3),
                                           "step_s": list(self._step_s), "steps_timed": self._steps_timed,
                                           "every_s": self._every_s})
        except OSError:
            pass  # best effort: a full or briefly unreachable filesystem must not end training; the watch sees silence

    def _run(self) -> None:
        while not self._stopped.wait(self._every_s):
            self.write()
