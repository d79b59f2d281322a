"""What both sides' atomic writes promise, proved on each (hybridflow.atomic for Airflow, hybridjobs.atomic for the
clusters; neither may import the other): a reader sees the old file or directory or the new one, and a failure
leaves the old one and no temporary or staging name behind. Side-specific behaviour is tested beside each module
(tests/unit/test_atomic.py, tests/unit/jobs/hybridjobs/test_atomic_jobs.py)."""

from __future__ import annotations

import json
import os

import pytest
from hybridflow import atomic as plugin_atomic
from hybridjobs import atomic as jobs_atomic


@pytest.fixture(params=[plugin_atomic, jobs_atomic], ids=["plugin", "jobs"])
def side(request):
    return request.param


def stage(side, target, files: dict[str, str]):
    with side.staged_dir(target) as staging:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)
    return target


def test_write_json_replaces_the_file_and_leaves_no_temporary(side, tmp_path):
    path = tmp_path / "registry.json"
    path.write_text("old")
    side.write_json_atomic(path, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2, sort_keys=True) + "\n"
    assert os.listdir(tmp_path) == ["registry.json"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_write_that_fails_midway_leaves_the_old_content_and_no_temporary(side, tmp_path, monkeypatch, step):
    def crash(*args, **kwargs):  # a full disk or a lost mount in the middle of the write
        raise OSError(f"simulated failure in os.{step}")

    path = tmp_path / "MANIFEST.json"
    path.write_text('{"old": true}')
    monkeypatch.setattr(side.os, step, crash)
    with pytest.raises(OSError, match="simulated"):
        side.write_json_atomic(path, {"new": True})
    assert path.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["MANIFEST.json"]


def test_a_value_json_cannot_hold_writes_nothing(side, tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    with pytest.raises(ValueError):
        side.write_json_atomic(path, {"loss": float("nan")}, allow_nan=False)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_a_staged_directory_replaces_the_old_one_whole(side, tmp_path):
    target = stage(side, tmp_path / "run" / "export", {"model.pt": "old", "old.json": "old"})
    stage(side, target, {"model.pt": "new", "charts/a.png": "new"})
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == [
        "charts/a.png", "model.pt"]
    assert (target / "model.pt").read_text() == "new"
    assert os.listdir(target.parent) == ["export"], "no staging or retired directory is left behind"


def test_a_failure_while_staging_leaves_the_old_directory_and_no_staging(side, tmp_path):
    target = stage(side, tmp_path / "export", {"model.pt": "old"})
    with pytest.raises(RuntimeError, match="export failed"), side.staged_dir(target) as staging:
        (staging / "model.pt").write_text("half")
        raise RuntimeError("export failed")
    assert (target / "model.pt").read_text() == "old"
    assert os.listdir(tmp_path) == ["export"]
