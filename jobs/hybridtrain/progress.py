"""``<run_dir>/progress.json``: what the orchestrator shows while the job runs, rewritten atomically.

Fields: ``state`` (starting, training, checkpointing, stopped, completed, failed), ``step``, ``total_steps``,
``epoch`` (full epochs completed), ``epochs_total``, ``loss`` (mean training loss since the previous write),
``samples_per_s`` (all processes), ``eta_s``, ``restarts``, ``resumed_from_step``, ``last_checkpoint_step``,
``slurm_job_id``, ``error`` (when failed) and ``updated_at`` (UTC, ISO 8601).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridtrain.checkpoints import write_json_atomic

__all__ = ["ProgressReporter", "read_progress"]


def read_progress(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


class ProgressReporter:
    """Writes the progress file at most every ``every_s`` seconds unless forced.

    :param rows_per_step: training rows all processes consume per step, for ``samples_per_s``.
    :param static: fields that do not change during the attempt (totals, restarts, job id).
    """

    def __init__(
        self,
        path: Path,
        *,
        every_s: float,
        rows_per_step: int,
        static: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._every_s = every_s
        self._rows_per_step = rows_per_step
        self._static = static
        self._clock = clock
        self._last_write: float | None = None
        self._rate_mark: tuple[float, int] | None = None
        self._steps_per_s: float | None = None
        self._loss_sum = 0.0
        self._loss_count = 0
        self._last_loss: float | None = None
        self.fields: dict[str, Any] = {}
        self.written: dict[str, Any] = {}

    def add_loss(self, loss: float) -> None:
        self._loss_sum += loss
        self._loss_count += 1

    def restart_rate(self, step: int) -> None:
        """Measure throughput from now and ``step`` on (after start-up, data loading and resume)."""
        self._rate_mark = (self._clock(), step)
        self._steps_per_s = None

    def update(self, *, state: str, step: int, force: bool = False, **fields: Any) -> bool:
        """Record the step; write when forced or ``every_s`` has passed. Returns whether it wrote."""
        now = self._clock()
        if self._rate_mark is None:
            self._rate_mark = (now, step)
        if not force and self._last_write is not None and now - self._last_write < self._every_s:
            return False
        mark_time, mark_step = self._rate_mark
        if step > mark_step and now - mark_time >= min(1.0, self._every_s / 2):
            self._steps_per_s = (step - mark_step) / (now - mark_time)
            self._rate_mark = (now, step)
        if self._loss_count:
            self._last_loss = self._loss_sum / self._loss_count
            self._loss_sum, self._loss_count = 0.0, 0
        total = self._static["total_steps"]
        self.fields.update(fields)
        payload = {
            **self._static,
            **self.fields,
            "state": state,
            "step": step,
            "loss": None if self._last_loss is None else round(self._last_loss, 6),
            "samples_per_s": None
            if self._steps_per_s is None
            else round(self._steps_per_s * self._rows_per_step, 2),
            "eta_s": None if not self._steps_per_s else round((total - step) / self._steps_per_s, 1),
            "updated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        write_json_atomic(self._path, payload)
        self.written = payload
        self._last_write = now
        return True
