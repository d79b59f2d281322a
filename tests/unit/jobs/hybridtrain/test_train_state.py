"""TrainingState: what the loop advances, a checkpoint carries to the next attempt, and metrics.json reports."""

from __future__ import annotations

import math

import pytest
from hybridtrain.errors import TrainingJobError
from hybridtrain.state import CLIENT_STATE_KEY, TrainingState


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_training_wall_time_counts_earlier_attempts_and_this_loop_only():
    clock = Clock()
    state = TrainingState(clock=clock, train_wall_prior_s=7.5)
    clock.now += 30  # start-up, data loading, resume: not training time
    state.start_loop()
    clock.now += 2.0004
    assert state.train_wall_s() == 9.5
    state.end_loop()
    clock.now += 5.0  # the export and metrics.json: not training time
    assert state.train_wall_s() == 9.5


def test_logged_losses_build_the_curve_and_a_diverged_loss_ends_the_run():
    state = TrainingState(step=5, last_checkpoint=None)
    state.record_loss(0.69314718)
    state.step, state.last_checkpoint = 10, 5
    state.record_loss(0.5)
    assert state.loss_curve == [[5, 0.693147], [10, 0.5]] and state.last_loss == 0.5
    state.step = 12
    with pytest.raises(TrainingJobError, match=r"training loss is nan at step 12: .* checkpoint is step 5"):
        state.record_loss(math.nan)
    assert state.loss_curve == [[5, 0.693147], [10, 0.5]] and state.last_loss == 0.5


def test_a_resumed_state_continues_where_the_checkpoint_left_off():
    clock = Clock()
    saved = TrainingState(step=40, clock=clock, train_wall_prior_s=1.0)
    saved.record_loss(0.4)
    saved.allreduce_samples.append([26, 3.5, None])
    clock.now += 2.0
    client_state = saved.client_state()
    assert client_state == {CLIENT_STATE_KEY: {"step": 40, "loss_curve": [[40, 0.4]], "train_wall_s": 3.0,
                                               "allreduce_samples": [[26, 3.5, None]]}}

    resumed = TrainingState(clock=clock)
    resumed.resume(40, client_state)
    assert (resumed.step, resumed.resumed_from, resumed.last_checkpoint) == (40, 40, 40)
    assert resumed.last_loss == 0.4 and resumed.allreduce_samples == [[26, 3.5, None]]
    resumed.start_loop()
    clock.now += 1.0
    assert resumed.train_wall_s() == 4.0


def test_a_checkpoint_without_losses_or_allreduce_samples_resumes():
    state = TrainingState()
    state.resume(3, {CLIENT_STATE_KEY: {"step": 3, "loss_curve": [], "train_wall_s": 0.5}})
    assert state.last_loss is None and state.allreduce_samples == [] and state.train_wall_prior_s == 0.5
