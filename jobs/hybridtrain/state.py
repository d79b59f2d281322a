"""Where one run stands: what the loop advances, a checkpoint carries to the next attempt, and ``metrics.json``
reports. Standard library only (and ``errors``).

A checkpoint stores the part that must survive a restart under its DeepSpeed client state, key ``hybridtrain``:
``step``, ``loss_curve``, ``train_wall_s`` and ``allreduce_samples``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridtrain.errors import TrainingJobError

__all__ = ["CLIENT_STATE_KEY", "TrainingState"]

CLIENT_STATE_KEY = "hybridtrain"


@dataclass
class TrainingState:
    """The run's position and history, on every rank (each rank keeps the same figures)."""

    step: int = 0
    resumed_from: int | None = None
    last_checkpoint: int | None = None
    loss_curve: list[list[float]] = field(default_factory=list)  # [step, loss] at each logged step
    last_loss: float | None = None
    # [step, step_ms, comm_ms] of the measured steps (see hybridtrain.allreduce), kept across resumes.
    allreduce_samples: list[list[float | None]] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None  # the latest holdout evaluation (its "step" says of which weights)
    train_wall_prior_s: float = 0.0  # training seconds of the attempts before this one
    clock: Callable[[], float] = time.monotonic
    loop_started: float = field(init=False)
    loop_ended: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.loop_started = self.clock()

    def start_loop(self) -> None:
        """Count this attempt's training time from now (after data loading, start-up and resume)."""
        self.loop_started = self.clock()

    def end_loop(self) -> None:
        """Stop counting training time: the export and what follows it are not training."""
        self.loop_ended = self.clock()

    def train_wall_s(self) -> float:
        """Seconds of the training loops, their checkpoints and evaluations included, this attempt's up to now or
        to its :meth:`end_loop`."""
        now = self.clock() if self.loop_ended is None else self.loop_ended
        return round(self.train_wall_prior_s + now - self.loop_started, 3)

    def record_loss(self, loss: float) -> None:
        """Keep a logged step's loss; a non-finite one ends the run (nothing after it is worth training)."""
        if not math.isfinite(loss):
            raise TrainingJobError(
                f"training loss is {loss} at step {self.step}: the run diverged (lower learning_rate); the "
                f"last complete checkpoint is step {self.last_checkpoint}"
            )
        self.last_loss = loss
        self.loss_curve.append([self.step, round(loss, 6)])

    def client_state(self) -> dict[str, Any]:
        """What the checkpoint of the current step carries, as DeepSpeed's ``client_state``."""
        return {
            CLIENT_STATE_KEY: {
                "step": self.step,
                "loss_curve": self.loss_curve,
                "train_wall_s": self.train_wall_s(),
                "allreduce_samples": self.allreduce_samples,
            }
        }

    def resume(self, step: int, client_state: Mapping[str, Any]) -> None:
        """Continue from the checkpoint at ``step``, whose DeepSpeed ``client_state`` is given."""
        saved = client_state[CLIENT_STATE_KEY]
        self.step = self.resumed_from = self.last_checkpoint = step
        self.loss_curve = saved["loss_curve"]
        self.train_wall_prior_s = saved["train_wall_s"]
        self.allreduce_samples = saved.get("allreduce_samples", [])  # older checkpoints lack them
        self.last_loss = self.loss_curve[-1][1] if self.loss_curve else None
