"""The training plan: deterministic batches, so a resumed run takes exactly the uninterrupted run's steps."""

from __future__ import annotations

import numpy as np
import pytest
from hybridtrain.errors import ConfigError
from hybridtrain.plan import epoch_permutation, make_plan


@pytest.mark.parametrize(
    ("rows", "batch", "accum", "world", "epochs", "max_steps", "per_epoch", "total"),
    [
        (1000, 100, 1, 1, 3, None, 10, 30),
        (1050, 100, 1, 1, 3, None, 10, 30),
        (1000, 100, 1, 2, 3, None, 5, 15),
        (1000, 100, 1, 1, None, 7, 10, 7),
        (1000, 100, 1, 1, 2, 25, 10, 20),
        (1000, 100, 1, 1, 5, 25, 10, 25),
        (100, 100, 1, 1, 1, None, 1, 1),
        (1000, 100, 2, 1, 3, None, 5, 15),
        (1000, 50, 2, 2, 1, None, 5, 5),
        (1000, 100, 4, 2, 1, None, 1, 1),
    ],
    ids=[
        "epochs",
        "drops-partial-batch",
        "two-ranks",
        "max-steps",
        "epochs-first",
        "max-steps-first",
        "one-batch",
        "accumulation",
        "accumulation-and-ranks",
        "one-step-per-epoch",
    ],
)
def test_training_plan_step_counts(rows, batch, accum, world, epochs, max_steps, per_epoch, total):
    plan = make_plan(
        n_train_rows=rows,
        batch_size=batch,
        world_size=world,
        seed=1,
        epochs=epochs,
        max_steps=max_steps,
        accumulation=accum,
    )
    assert (plan.steps_per_epoch, plan.total_steps, plan.rows_per_step) == (per_epoch, total, batch * accum * world)
    assert plan.as_dict()["accumulation"] == accum, "the plan, and so the resume key, records the accumulation"


@pytest.mark.parametrize(
    ("batch", "accum", "world", "message"),
    [
        (64, 1, 2, "batch_size: 64 x 1 accumulation steps x 2 processes needs more rows than the 100"),
        (30, 4, 1, "batch_size: 30 x 4 accumulation steps x 1 processes needs more rows than the 100"),
    ],
    ids=["ranks", "accumulation"],
)
def test_training_plan_needs_one_full_step_of_rows(batch, accum, world, message):
    with pytest.raises(ConfigError, match=message) as raised:
        make_plan(
            n_train_rows=100, batch_size=batch, world_size=world, seed=1, epochs=1, max_steps=None, accumulation=accum
        )
    assert "gradient_accumulation_steps" in str(raised.value)


@pytest.mark.parametrize(
    ("batch", "accum", "world", "expected"),
    [
        (2, 1, 1, {(0, 0): [0, 1]}),
        (1, 2, 1, {(0, 0): [0], (0, 1): [1]}),
        (1, 1, 2, {(0, 0): [0], (1, 0): [1]}),
        (1, 2, 2, {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}),
        (2, 2, 2, {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}),
    ],
    ids=["one-rank", "accumulation", "two-ranks", "micro-batch-major", "wider-batches"],
)
def test_training_plan_micro_batch_m_of_rank_r_takes_slice_m_x_world_plus_r(batch, accum, world, expected):
    """Positions within step 1's rows of the epoch permutation, per (rank, micro-batch)."""
    plan = make_plan(
        n_train_rows=64, batch_size=batch, world_size=world, seed=5, epochs=1, max_steps=None, accumulation=accum
    )
    order = epoch_permutation(64, 5, 0)
    start = plan.rows_per_step
    for (rank, micro), positions in expected.items():
        assert plan.batch_rows(1, rank, micro).tolist() == [order[start + p] for p in positions]


def test_training_plan_same_global_batch_takes_the_same_rows_however_it_is_split():
    def step_rows(batch: int, accum: int, world: int, step: int) -> list[int]:
        plan = make_plan(
            n_train_rows=1000, batch_size=batch, world_size=world, seed=4, epochs=2, max_steps=None, accumulation=accum
        )
        return sorted(
            row for rank in range(world) for micro in range(accum) for row in plan.batch_rows(step, rank, micro)
        )

    for step in (0, 7, 12):
        splits = [step_rows(*split, step) for split in ((40, 1, 1), (20, 1, 2), (20, 2, 1), (10, 2, 2), (5, 4, 2))]
        assert all(rows == splits[0] for rows in splits), f"step {step}"


def test_training_plan_visits_every_row_once_per_epoch_across_ranks():
    plan = make_plan(n_train_rows=103, batch_size=5, world_size=2, seed=3, epochs=2, max_steps=None)
    for epoch in range(2):
        steps = range(epoch * plan.steps_per_epoch, (epoch + 1) * plan.steps_per_epoch)
        seen = np.concatenate([plan.batch_rows(step, rank) for step in steps for rank in range(2)])
        assert len(seen) == len(set(seen.tolist())) == 100
    accumulating = make_plan(
        n_train_rows=103, batch_size=5, world_size=2, seed=3, epochs=1, max_steps=None, accumulation=3
    )
    seen = np.concatenate(
        [
            accumulating.batch_rows(step, rank, micro)
            for step in range(accumulating.steps_per_epoch)
            for rank in range(2)
            for micro in range(3)
        ]
    )
    assert len(seen) == len(set(seen.tolist())) == 90, "3 steps of 30 rows; the last 13 rows are dropped"
    first, second = (plan.batch_rows(step, 0) for step in (0, plan.steps_per_epoch))
    assert not np.array_equal(first, second), "each epoch has its own order"


def test_training_plan_batches_depend_only_on_seed_and_step():
    plan = make_plan(n_train_rows=500, batch_size=16, world_size=1, seed=9, epochs=3, max_steps=None)
    uninterrupted = [plan.batch_rows(step, 0).copy() for step in range(plan.total_steps)]
    epoch_permutation.cache_clear()
    resumed = make_plan(n_train_rows=500, batch_size=16, world_size=1, seed=9, epochs=3, max_steps=None)
    resume_at = plan.steps_per_epoch + 7
    for step in range(resume_at, plan.total_steps):
        assert np.array_equal(resumed.batch_rows(step, 0), uninterrupted[step])
    other_seed = make_plan(n_train_rows=500, batch_size=16, world_size=1, seed=10, epochs=3, max_steps=None)
    assert not np.array_equal(other_seed.batch_rows(0, 0), uninterrupted[0])


def test_training_plan_epochs_completed():
    plan = make_plan(n_train_rows=100, batch_size=10, world_size=1, seed=0, epochs=3, max_steps=None)
    assert [plan.epochs_completed(step) for step in (0, 9, 10, 29, 30)] == [0, 0, 1, 2, 3]
