"""hybridflow.atomic: a reader sees the old file or directory or the new one; a failure leaves the old one and no
temporary or staging name behind; modes are those asked for."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hybridflow import atomic
from hybridflow.atomic import STALE_STAGING_S, SwapError, staged_dir, write_bytes_atomic


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def fail_on(monkeypatch, name: str) -> None:
    """Make ``os.<name>`` raise, as a crash (a full disk, a lost mount) in the middle of a write would."""
    def crash(*args, **kwargs):
        raise OSError(f"simulated failure in os.{name}")

    monkeypatch.setattr(atomic.os, name, crash)


# --- files --------------------------------------------------------------------------------------------------


def test_a_file_gets_the_mode_of_any_new_file_or_the_one_asked_for(tmp_path, umask_022):
    plain, chosen = tmp_path / "plain", tmp_path / "chosen"
    chosen.write_bytes(b"old")
    chosen.chmod(0o600)
    write_bytes_atomic(plain, b"x")
    write_bytes_atomic(chosen, b"y", mode=0o664)  # not limited by the umask
    assert mode_of(plain) == 0o644  # as open(path, "w") makes it
    assert (mode_of(chosen), chosen.read_bytes()) == (0o664, b"y")


def test_a_temporary_directory_keeps_the_target_directory_free_of_temporary_names(tmp_path, monkeypatch):
    model_dir, temp_dir = tmp_path / "repo" / "m", tmp_path / "repo" / ".staging"
    model_dir.mkdir(parents=True)
    temp_dir.mkdir()
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: (seen.append(Path(src).parent), real_replace(src, dst)))
    write_bytes_atomic(model_dir / "config.pbtxt", b"name: 'm'", temp_dir=temp_dir)
    assert seen == [temp_dir]
    assert os.listdir(model_dir) == ["config.pbtxt"] and os.listdir(temp_dir) == []


# --- directories --------------------------------------------------------------------------------------------


def stage(target: Path, files: dict[str, str], **options) -> Path:
    with staged_dir(target, **options) as staging:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)
    return target


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = stage(tmp_path / "run1", {"report.json": "old"})
    real_rename = os.rename

    def rename(src, dst):
        if ".staging-" in str(src):
            raise OSError(5, "simulated I/O error", str(src), None, str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(SwapError, match="simulated I/O error"):
        stage(target, {"report.json": "new"})
    assert (target / "report.json").read_text() == "old"
    assert os.listdir(tmp_path) == ["run1"]


def test_without_replace_a_published_directory_is_never_overwritten(tmp_path):
    target = stage(tmp_path / "v1", {"model.pt": "first"})
    with pytest.raises(SwapError) as raised:
        stage(target, {"model.pt": "second"}, replace=False)
    assert isinstance(raised.value, OSError) and str(target) in str(raised.value)
    assert (target / "model.pt").read_text() == "first"
    assert os.listdir(tmp_path) == ["v1"]


def test_staging_elsewhere_and_the_staging_directory_mode(tmp_path, umask_022):
    root = tmp_path / "repo"
    staging_parent = root / ".staging"
    with staged_dir(root / "m" / "3", replace=False, staging_parent=staging_parent, mode=0o700) as staging:
        assert staging.parent == staging_parent and mode_of(staging) == 0o700
        assert not (root / "m").exists(), "the target's directory appears only with the target"
        (staging / "model.pt").write_text("m")
    assert (root / "m" / "3" / "model.pt").read_text() == "m" and mode_of(root / "m" / "3") == 0o700
    assert os.listdir(staging_parent) == []


def test_every_staged_file_is_flushed_before_the_swap(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(atomic.os, "rename", lambda src, dst: (events.append("rename"), real_rename(src, dst)))
    stage(tmp_path / "run1", {"a.json": "1", "sub/b.png": "2"})
    # two files, two directories, then the rename, then the parent's entry
    assert events == ["fsync"] * 4 + ["rename", "fsync"]


def test_stale_leftovers_of_crashed_writers_are_removed_and_recent_ones_kept(tmp_path):
    target = tmp_path / "run1"
    stale, recent = tmp_path / ".run1.staging-dead", tmp_path / ".run1.retired-live"
    stale.mkdir()
    recent.mkdir()
    old = time.time() - STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    stage(target, {"report.json": "x"})
    assert not stale.exists() and recent.exists()
