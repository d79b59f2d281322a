"""hybridjobs.atomic, the jobs' atomic writes: a reader sees the old file or directory or the new one; a failure
leaves the old one and no temporary or staging name behind; a file gets the mode any new file gets."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from hybridjobs import atomic
from hybridjobs.atomic import STALE_STAGING_S, new_staging_dir, staged_dir, swap_in, write_json_atomic


def fail_on(monkeypatch, name: str) -> None:
    """Make ``os.<name>`` raise, as a crash (a full disk, a lost mount) in the middle of a write would."""
    def crash(*args, **kwargs):
        raise OSError(f"simulated failure in os.{name}")

    monkeypatch.setattr(atomic.os, name, crash)


def test_write_json_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text("old")
    write_json_atomic(path, {"step": 3, "at": "x"}, sort_keys=True)
    assert json.loads(path.read_text()) == {"at": "x", "step": 3} and path.read_text().endswith("}\n")
    assert os.listdir(tmp_path) == ["progress.json"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_write_that_fails_midway_leaves_the_old_content_and_no_temporary(tmp_path, monkeypatch, step):
    path = tmp_path / "MANIFEST.json"
    path.write_text('{"old": true}')
    fail_on(monkeypatch, step)
    with pytest.raises(OSError, match="simulated"):
        write_json_atomic(path, {"new": True})
    assert path.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["MANIFEST.json"]


def test_a_value_json_cannot_hold_writes_nothing(tmp_path):
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "metrics.json", {"loss": float("nan")}, allow_nan=False)
    assert os.listdir(tmp_path) == []


def test_a_file_gets_the_mode_any_new_file_gets(tmp_path):
    previous = os.umask(0o002)  # the shared storage's umask: group-writable
    try:
        path = tmp_path / "_MANIFEST.json"
        write_json_atomic(path, {})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664


def staged(target: Path, files: dict[str, str]) -> Path:
    with staged_dir(target) as staging:
        for name, text in files.items():
            (staging / name).write_text(text)
    return target


def test_a_staged_directory_replaces_the_old_one_whole(tmp_path):
    target = staged(tmp_path / "run" / "export", {"model.pt": "old", "old.json": "old"})
    staged(target, {"model.pt": "new"})
    assert os.listdir(target) == ["model.pt"] and (target / "model.pt").read_text() == "new"
    assert os.listdir(target.parent) == ["export"], "no staging or retired directory is left behind"


def test_a_failure_while_staging_leaves_the_old_directory_and_no_staging(tmp_path):
    target = staged(tmp_path / "export", {"model.pt": "old"})
    with pytest.raises(RuntimeError, match="export failed"), staged_dir(target) as staging:
        (staging / "model.pt").write_text("half")
        raise RuntimeError("export failed")
    assert (target / "model.pt").read_text() == "old"
    assert os.listdir(tmp_path) == ["export"]


def test_a_failed_swap_puts_the_old_partition_back(tmp_path, monkeypatch):
    target = staged(tmp_path / "ds=2026-01-05", {"part-0.parquet": "old"})
    staging = new_staging_dir(target)
    staging.mkdir()
    (staging / "part-0.parquet").write_text("new")
    real_rename = os.rename

    def rename(src, dst):
        if ".staging-" in str(src):
            raise OSError("simulated failure of the swap")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        swap_in(staging, target)
    assert (target / "part-0.parquet").read_text() == "old"
    assert not list(tmp_path.glob(".ds=2026-01-05.retired-*"))


def test_new_staging_dir_is_a_hidden_sibling_not_yet_created(tmp_path):
    target = tmp_path / "features" / "ds=2026-01-05"
    staging = new_staging_dir(target)
    assert staging.parent == target.parent and staging.name.startswith(".ds=2026-01-05.staging-")
    assert target.parent.is_dir() and not staging.exists()  # Spark creates its output directory itself


def test_stale_leftovers_of_crashed_runs_are_removed_and_recent_ones_kept(tmp_path):
    target = tmp_path / "ds=2026-01-05"
    stale, recent = tmp_path / ".ds=2026-01-05.retired-dead", tmp_path / ".ds=2026-01-05.staging-live"
    stale.mkdir()
    recent.mkdir()
    old = time.time() - STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    new_staging_dir(target)
    assert not stale.exists() and recent.exists()
