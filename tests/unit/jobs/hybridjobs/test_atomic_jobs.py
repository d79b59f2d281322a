"""hybridjobs.atomic, the jobs' atomic writes: a reader sees the old file or directory or the new one; a failure
leaves the old one and no temporary or staging name behind; a file gets the mode any new file gets."""

from __future__ import annotations

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
