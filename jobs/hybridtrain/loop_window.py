"""The training loop's own pace (issue 37): its steps between timed points, without start-up, checkpoints,
evaluations or the export.

A timed point is where the loop already waits for the device: the loss it reads every ``log_every_steps`` (and
the last step), and the start and the end of a checkpoint (which synchronizes first). A clock read there means
every step before it has finished. A span runs from one timed point to the next with nothing but steps between
them; the first span starts at the first timed point, so the steps before it (allocations, kernel selection: the
reference's warm-up) stay outside. ``metrics.json``'s headline figures, ``loop``, come from the spans: rows/s
over their steps, the median step (per span: its seconds over its steps) and the GPU utilization sampled inside
them. This attempt's spans only: a resumed run reports the steps since its resume. Standard library only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybridtrain.gpu import summarise_gpu_metrics, within

__all__ = ["LoopWindow", "Span"]


@dataclass(frozen=True)
class Span:
    """Steps ``first_step`` (exclusive) to ``last_step`` (inclusive), run from ``started`` to ``ended`` (epoch s)."""

    started: float
    ended: float
    first_step: int
    last_step: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class LoopWindow:
    """The spans of one attempt's loop, from the timed points it is told of.

    :param clock: epoch seconds (the GPU sampler's timestamps are wall-clock).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._open: tuple[float, int] | None = None
        self.spans: list[Span] = []

    def mark(self, step: int) -> None:
        """A timed point after step ``step``: the open span ends here and the next one starts."""
        now = self._clock()
        if self._open is not None and step > self._open[1]:
            self.spans.append(Span(self._open[0], now, self._open[1], step))
        self._open = (now, step)

    def pause(self, step: int) -> None:
        """Work other than steps starts after step ``step`` (a timed point): the next span starts at the next mark."""
        self.mark(step)
        self._open = None

    def figures(self, rows_per_step: int, gpu_records: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """``metrics.json``'s ``loop``: steps, seconds, rows/s, median step and GPU utilization inside the spans
        (None where no span was timed: a run of no more steps than one ``log_every_steps``)."""
        steps = sum(span.steps for span in self.spans)
        seconds = sum(span.seconds for span in self.spans)
        windows: list[tuple[float, float]] = []  # the spans, those without a pause between them joined
        for span in self.spans:
            if windows and windows[-1][1] == span.started:
                windows[-1] = (windows[-1][0], span.ended)
            else:
                windows.append((span.started, span.ended))
        gpu = summarise_gpu_metrics(within(gpu_records, windows))
        return {
            "from_step": self.spans[0].first_step if self.spans else None,
            "to_step": self.spans[-1].last_step if self.spans else None,
            "steps": steps,
            "seconds": round(seconds, 3),
            "rows_per_s": round(steps * rows_per_step / seconds, 2) if seconds > 0 else None,
            "step_ms_median": round(statistics.median(span.seconds / span.steps * 1e3 for span in self.spans), 3)
            if self.spans else None,
            "gpu_utilization_pct": gpu["mean_utilization_pct"],
            "gpu_samples": gpu["samples"],
        }
