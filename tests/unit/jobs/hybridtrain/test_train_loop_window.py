"""The training loop's own pace (hybridtrain.loop_window): steps between timed points, pauses left out, on a clock
the test moves; GPU samples counted only inside the spans."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hybridtrain.loop_window import LoopWindow

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def sample(at: float, utilization: float) -> dict:
    return {"ts": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds"), "host": "n1", "rank": 0,
            "gpu_available": True, "gpus": [{"index": 0, "uuid": "GPU-1", "utilization_pct": utilization}]}


def test_loop_window_counts_steps_between_timed_points_and_leaves_pauses_and_warm_up_out():
    clock = Clock()
    window = LoopWindow(clock)
    clock.now += 9.0  # steps 1-10: warm-up, before the first timed point
    window.mark(10)
    clock.now += 1.0
    window.mark(20)  # 10 steps in 1 s
    window.pause(20)  # a checkpoint: 4 s that are no steps
    clock.now += 4.0
    window.mark(20)
    clock.now += 2.0
    window.mark(30)  # 10 steps in 2 s
    records = [sample(T0 + 5.0, 5.0), sample(T0 + 9.5, 90.0), sample(T0 + 12.0, 10.0), sample(T0 + 15.5, 80.0)]
    figures = window.figures(rows_per_step=64, gpu_records=records)
    assert figures == {"from_step": 10, "to_step": 30, "steps": 20, "seconds": 3.0,
                       "rows_per_s": pytest.approx(20 * 64 / 3.0, abs=0.01), "step_ms_median": 150.0,
                       "gpu_utilization_pct": 85.0, "gpu_samples": 2}


def test_loop_window_without_two_timed_points_measures_nothing():
    clock = Clock()
    window = LoopWindow(clock)
    clock.now += 3.0
    window.mark(5)  # a run of 5 steps that logs only its last one
    window.pause(5)
    assert window.figures(rows_per_step=64, gpu_records=[sample(T0 + 1.0, 50.0)]) == {
        "from_step": None, "to_step": None, "steps": 0, "seconds": 0.0, "rows_per_s": None, "step_ms_median": None,
        "gpu_utilization_pct": None, "gpu_samples": 0}
