"""The deterministic order of training batches, so a resumed run takes exactly the steps an uninterrupted one
would: epoch ``e`` visits the training rows in a permutation seeded by ``(seed, e)``, each optimizer step takes
the next ``batch_size * accumulation * world_size`` rows (the last partial step of an epoch is dropped), and
micro-batch ``m`` of rank ``r`` takes slice ``m * world_size + r`` of them. Resuming at step ``s`` therefore
re-enters epoch ``s // steps_per_epoch`` and skips the ``s % steps_per_epoch`` steps it had already seen.

The slices are numbered micro-batch first, then rank, so the rows of one optimizer step are the same for every
split of the global batch into ranks and micro-batches: 2 ranks x 1 micro-batch of ``b`` rows, 1 rank x 2
micro-batches of ``b`` and 1 rank x 1 micro-batch of ``2b`` all take rows ``[start, start + 2b)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
from hybridtrain.errors import ConfigError

__all__ = ["TrainingPlan", "epoch_permutation", "make_plan"]


@dataclass(frozen=True)
class TrainingPlan:
    """``batch_size`` is one rank's micro-batch; ``accumulation`` micro-batches per rank make one step."""

    n_train_rows: int
    batch_size: int
    world_size: int
    seed: int
    steps_per_epoch: int
    total_steps: int
    accumulation: int = 1

    @property
    def rows_per_step(self) -> int:
        """The global batch: rows all ranks take in one optimizer step."""
        return self.batch_size * self.accumulation * self.world_size

    def epochs_completed(self, step: int) -> int:
        return step // self.steps_per_epoch

    def batch_position(self, step: int, rank: int, micro: int = 0) -> tuple[int, int]:
        """``(epoch, start)``: micro-batch ``micro`` of 0-based optimizer ``step`` on ``rank`` is
        ``epoch_permutation(..., epoch)[start : start + batch_size]``."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        return epoch, batch * self.rows_per_step + (micro * self.world_size + rank) * self.batch_size

    def batch_rows(self, step: int, rank: int, micro: int = 0) -> np.ndarray:
        """Indices into the training rows for micro-batch ``micro`` of 0-based optimizer ``step`` on ``rank``."""
        epoch, start = self.batch_position(step, rank, micro)
        return epoch_permutation(self.n_train_rows, self.seed, epoch)[start : start + self.batch_size]

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def make_plan(
    *,
    n_train_rows: int,
    batch_size: int,
    world_size: int,
    seed: int,
    epochs: int | None,
    max_steps: int | None,
    accumulation: int = 1,
) -> TrainingPlan:
    """The plan for a run; training stops after ``epochs`` full passes or ``max_steps`` optimizer steps,
    whichever is first.

    :param accumulation: micro-batches per rank and optimizer step (``gradient_accumulation_steps``).
    :raises ConfigError: when one step needs more rows than the training split has.
    """
    steps_per_epoch = n_train_rows // (batch_size * accumulation * world_size)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"batch_size: {batch_size} x {accumulation} accumulation steps x {world_size} processes needs more "
            f"rows than the {n_train_rows} training rows: lower batch_size or gradient_accumulation_steps, or "
            "train on more partitions"
        )
    limits = [limit for limit in (epochs and epochs * steps_per_epoch, max_steps) if limit]
    return TrainingPlan(
        n_train_rows=n_train_rows,
        batch_size=batch_size,
        world_size=world_size,
        seed=seed,
        steps_per_epoch=steps_per_epoch,
        total_steps=min(limits),
        accumulation=accumulation,
    )


@lru_cache(maxsize=2)
def epoch_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n_rows)
    order.flags.writeable = False
    return order
