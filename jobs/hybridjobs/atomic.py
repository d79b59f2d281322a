"""Atomic writes for the jobs: a reader sees the old file or directory or the new one, never half of one.

A file is written under a hidden temporary name beside it (``.<name>.<token>.tmp``: Spark and pyarrow skip names
starting with a dot, checkpoint manifests skip names ending in ``.tmp``), flushed to disk and renamed over it. A
directory is built in a hidden staging directory beside it (``.<name>.staging-<token>``), flushed and swapped in:
a previous one is first renamed aside (``.<name>.retired-<token>``) and deleted after the swap, or put back if the
swap fails. Between those two renames (microseconds) the target is absent, never half-written. Renames are atomic
on one POSIX file system (local disk, NFS, Lustre); object stores need a different commit protocol.

Standard library only: the Spark executors (this package is shipped to them) and the training job
(``hybridtrain``, run from the same ``jobs/`` directory) import it. ``plugins/hybridflow/atomic.py`` is the same
helper on the Airflow side, which the jobs never import.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["STALE_STAGING_S", "new_staging_dir", "staged_dir", "swap_in", "write_json_atomic"]

# A staging or retired directory older than this is a crashed run's; a younger one may belong to a run still writing.
STALE_STAGING_S = 3600


def write_json_atomic(path: str | os.PathLike, payload: Any, *, indent: int | None = 2, **json_options: Any) -> None:
    """Replace ``path`` with ``payload`` as JSON text plus a newline, in one step and durably. The text is encoded
    before anything is written, so a value JSON cannot hold (``allow_nan=False``) leaves no file behind."""
    path = Path(path)
    data = (json.dumps(payload, indent=indent, **json_options) + "\n").encode()
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def new_staging_dir(target: str | os.PathLike) -> Path:
    """A fresh staging path beside ``target``, not created yet (Spark creates its output directory itself); its
    parent is created, and leftovers of crashed runs for the same target older than :data:`STALE_STAGING_S`
    are removed. Recent ones are kept: they may belong to a run still writing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for pattern in (f".{target.name}.staging-*", f".{target.name}.retired-*"):
        for leftover in target.parent.glob(pattern):
            try:
                if now - leftover.stat().st_mtime > STALE_STAGING_S:
                    shutil.rmtree(leftover, ignore_errors=True)
            except FileNotFoundError:
                pass
    return target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:12]}"


def swap_in(staging: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Flush ``staging`` to disk and rename it to ``target``; an existing ``target`` is renamed aside first and
    deleted after the swap, or put back if the swap fails."""
    staging, target = Path(staging), Path(target)
    _fsync_tree(staging)
    retired = target.parent / f".{target.name}.retired-{uuid.uuid4().hex[:12]}"
    had_previous = target.exists()
    if had_previous:
        os.rename(target, retired)
    try:
        os.rename(staging, target)
    except OSError:
        if had_previous:
            os.rename(retired, target)
        raise
    _fsync_dir(target.parent)
    if had_previous:
        shutil.rmtree(retired, ignore_errors=True)
    return target


@contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty staging directory beside ``target``, swapped in as ``target`` (:func:`swap_in`) when the
    block exits cleanly; on any failure it is removed and ``target`` is as it was."""
    staging = new_staging_dir(target)
    staging.mkdir()
    try:
        yield staging
        swap_in(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(directory)
