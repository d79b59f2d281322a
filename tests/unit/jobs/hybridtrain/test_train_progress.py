"""progress.json of the training job: throttled, atomic, with throughput and ETA."""

from __future__ import annotations

import json
from pathlib import Path

from hybridtrain.progress import ProgressReporter, read_progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reporter(tmp_path: Path, clock: FakeClock) -> ProgressReporter:
    return ProgressReporter(
        tmp_path / "progress.json",
        every_s=5.0,
        rows_per_step=64,
        static={"total_steps": 1000, "restarts": 1, "run_id": "r"},
        clock=clock,
    )


def test_training_progress_is_throttled_and_reports_rate_and_eta(tmp_path):
    clock = FakeClock()
    progress = reporter(tmp_path, clock)
    assert progress.update(state="training", step=0, epoch=0, last_checkpoint_step=None)
    clock.now += 1
    assert not progress.update(state="training", step=10)
    progress.add_loss(0.7)
    progress.add_loss(0.5)
    clock.now += 4
    assert progress.update(state="training", step=100, epoch=0, last_checkpoint_step=None)
    written = read_progress(tmp_path / "progress.json")
    assert written["step"] == 100
    assert written["loss"] == 0.6
    assert written["samples_per_s"] == 20.0 * 64
    assert written["eta_s"] == 900 / 20.0
    assert (written["total_steps"], written["restarts"], written["run_id"]) == (1000, 1, "r")
    assert {"epoch", "last_checkpoint_step", "updated_at", "state"} <= set(written)
    assert not list(tmp_path.glob("*.tmp"))


def test_training_progress_forced_write_keeps_fields_and_rate(tmp_path):
    clock = FakeClock()
    progress = reporter(tmp_path, clock)
    progress.update(state="training", step=0, epoch=0, last_checkpoint_step=None)
    clock.now += 10
    progress.update(state="training", step=100)
    clock.now += 0.1
    assert progress.update(state="checkpointing", step=101, force=True, last_checkpoint_step=100)
    written = json.loads((tmp_path / "progress.json").read_text())
    assert (written["state"], written["epoch"], written["last_checkpoint_step"]) == ("checkpointing", 0, 100)
    assert written["samples_per_s"] == 10.0 * 64
    assert written["loss"] is None


def test_training_progress_rate_restarts_after_resume(tmp_path):
    clock = FakeClock()
    progress = reporter(tmp_path, clock)
    progress.update(state="starting", step=0, force=True)
    clock.now += 30
    progress.restart_rate(400)
    clock.now += 5
    progress.update(state="training", step=450)
    assert read_progress(tmp_path / "progress.json")["samples_per_s"] == 10.0 * 64


def test_training_read_progress_tolerates_absent_or_bad_files(tmp_path):
    assert read_progress(tmp_path / "absent.json") is None
    (tmp_path / "bad.json").write_text("[1]")
    assert read_progress(tmp_path / "bad.json") is None
