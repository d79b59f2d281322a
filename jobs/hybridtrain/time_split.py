"""Where a training rank's wall time goes (issue 25): seconds per phase, as the heartbeat hears the phases.

The runner already names its phases for the stall watch (``loading data``, ``rendezvous``, ``training``,
``checkpointing``, ...); :class:`PhaseClock` adds up the wall time between one phase change and the next. Rank 0's
totals go into ``metrics.json`` (``time_split_s``); the orchestrator turns them into shares of the job's allocated
time (``hybridflow.utils.efficiency.time_shares``). Standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# the runner's phase -> the category it is reported under
CATEGORIES = {
    "starting": "startup",  # interpreter, torch and DeepSpeed imports, before the data is read
    "loading data": "data_loading",
    "rendezvous": "rendezvous",  # process group, DeepSpeed engine
    "resuming": "checkpoint_reads",
    "training": "training_steps",
    "checkpointing": "checkpoint_writes",
    "evaluating": "evaluation",
    "finishing": "export",
}


class PhaseClock:
    """Wall seconds per category, the current phase counted up to now."""

    def __init__(self, phase: str = "starting", clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._phase, self._since = phase, clock()
        self._seconds: dict[str, float] = {}

    def enter(self, phase: str) -> None:
        if phase == self._phase:
            return
        now = self._clock()
        self._add(self._phase, now - self._since)
        self._phase, self._since = phase, now

    def seconds(self) -> dict[str, float]:
        totals = dict(self._seconds)
        category = CATEGORIES.get(self._phase, self._phase)
        totals[category] = totals.get(category, 0.0) + self._clock() - self._since
        return {name: round(value, 3) for name, value in totals.items()}

    def _add(self, phase: str, seconds: float) -> None:
        category = CATEGORIES.get(phase, phase)
        self._seconds[category] = self._seconds.get(category, 0.0) + max(seconds, 0.0)
