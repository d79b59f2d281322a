"""A rank's heartbeat times its training steps for the stall watch: a step is the time since the step before it, or
since training resumed after a checkpoint; phases, evaluation chunks and a resume's jump are never a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridtrain.heartbeat import STEP_WINDOW, Heartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def written(heartbeat: Heartbeat, path: Path) -> dict:
    path.parent.mkdir(exist_ok=True)
    heartbeat.write()
    return json.loads(path.read_text())


@pytest.mark.parametrize("beats, step_s", [
    # (seconds later, step, phase): the loop's beats
    ([(3, 10, "training"), (0.5, 11, None), (0.25, 12, None)], [0.5, 0.25]),
    # a checkpoint between two steps: the next step counts from training's return, not across the checkpoint
    ([(0, 20, "training"), (0.5, 21, None), (0, None, "checkpointing"), (9, None, "evaluating"), (4, None, None),
      (2, None, "training"), (0.5, 22, None)], [0.5, 0.5]),
    # a resume jumps to the checkpoint's step with its phase: no step timed until the next one
    ([(30, 400, "training"), (0.5, 401, None)], [0.5]),
    # a step beat outside training, and a step that is not the next one: not timed
    ([(0, 5, "evaluating"), (1, 6, None), (0, None, "training"), (1, 8, None)], []),
])
def test_only_training_steps_are_timed(tmp_path, beats, step_s):
    clock = Clock()
    heartbeat = Heartbeat(tmp_path, rank=0, node="gpu-node-01", environ={}, every_s=60, clock=clock)
    for later, step, phase in beats:
        clock.now += later
        heartbeat.beat(step=step, phase=phase)
    data = written(heartbeat, tmp_path / "heartbeats" / "rank0.json")
    assert (data["step_s"], data["steps_timed"]) == (step_s, len(step_s))


def test_the_heartbeat_keeps_the_last_steps_and_counts_them_all(tmp_path):
    clock = Clock()
    heartbeat = Heartbeat(tmp_path, rank=1, node="gpu-node-02", environ={}, every_s=60, clock=clock)
    heartbeat.beat(step=0, phase="training")
    for step in range(1, 101):
        clock.now += step / 1000
        heartbeat.beat(step=step)
    data = written(heartbeat, tmp_path / "heartbeats" / "rank1.json")
    assert data["steps_timed"] == 100 and len(data["step_s"]) == STEP_WINDOW
    assert data["step_s"] == pytest.approx([step / 1000 for step in range(101 - STEP_WINDOW, 101)])
