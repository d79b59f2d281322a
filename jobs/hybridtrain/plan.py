"""The deterministic order of training batches, so a resumed run takes exactly the steps an uninterrupted one
would: epoch ``e`` visits the training rows in a permutation seeded by ``(seed, e)``, each step takes the next
``batch_size * world_size`` rows (the last partial batch of an epoch is dropped), and rank ``r`` takes the
``r``-th slice of them. Resuming at step ``s`` therefore re-enters epoch ``s // steps_per_epoch`` and skips
the ``s % steps_per_epoch`` batches it had already seen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
from hybridtrain.errors import ConfigError

__all__ = ["TrainingPlan", "epoch_permutation", "make_plan"]


@dataclass(frozen=True)
class TrainingPlan:
    n_train_rows: int
    batch_size: int
    world_size: int
    seed: int
    steps_per_epoch: int
    total_steps: int

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.world_size

    def epochs_completed(self, step: int) -> int:
        return step // self.steps_per_epoch

    def batch_rows(self, step: int, rank: int) -> np.ndarray:
        """Indices into the training rows for the batch of 0-based ``step`` on ``rank``."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        start = batch * self.rows_per_step + rank * self.batch_size
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
) -> TrainingPlan:
    """The plan for a run; training stops after ``epochs`` full passes or ``max_steps``, whichever is first.

    :raises ConfigError: when one step needs more rows than the training split has.
    """
    steps_per_epoch = n_train_rows // (batch_size * world_size)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"batch_size: {batch_size} x {world_size} processes needs more rows than the {n_train_rows} "
            "training rows: lower batch_size or train on more partitions"
        )
    limits = [limit for limit in (epochs and epochs * steps_per_epoch, max_steps) if limit]
    return TrainingPlan(
        n_train_rows=n_train_rows,
        batch_size=batch_size,
        world_size=world_size,
        seed=seed,
        steps_per_epoch=steps_per_epoch,
        total_steps=min(limits),
    )


@lru_cache(maxsize=2)
def epoch_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n_rows)
    order.flags.writeable = False
    return order
