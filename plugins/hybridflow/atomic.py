"""Atomic writes on the shared storage: a reader sees the old file or directory or the new one, never half of one.

A file is written under a hidden temporary name beside it (``.<name>.<token>.tmp``), flushed to disk and renamed
over it. A directory is built in a hidden staging directory (``.<name>.staging-<token>``), flushed and renamed
into place; a previous one is first renamed aside (``.<name>.retired-<token>``) and deleted after the swap, or put
back if the swap fails. A failure removes what it wrote. Renames are atomic on one POSIX file system (local disk,
NFS, Lustre), so temporary and staging names always live on the target's file system.

Standard library only. ``jobs/hybridjobs/atomic.py`` is the same helper for the code shipped to the clusters.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["STALE_STAGING_S", "SwapError", "staged_dir", "write_bytes_atomic", "write_json_atomic"]

# A staging or retired directory older than this is a crashed writer's; a younger one may belong to one still running.
STALE_STAGING_S = 3600


class SwapError(OSError):
    """A staged directory could not be renamed into place (without ``replace``: the target exists and is not
    empty). Its text is the rename's own."""


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, mode: int | None = None,
                       temp_dir: str | os.PathLike | None = None) -> None:
    """Replace ``path`` with ``data`` in one step, durably.

    :param mode: the file's permission bits; by default those of any new file (0o666 less the umask).
    :param temp_dir: where the temporary file is written, on the same file system; by default beside ``path``.
        Give one when a reader lists ``path``'s directory and must never see a temporary name there.
    """
    path = Path(path)
    temp = Path(temp_dir or path.parent) / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            handle.write(data)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike, payload: Any, *, mode: int | None = None, indent: int | None = 2,
                      **json_options: Any) -> None:
    """``payload`` as JSON text plus a newline, written with :func:`write_bytes_atomic`. It is encoded before
    anything is written, so a value JSON cannot hold leaves no file behind."""
    text = json.dumps(payload, indent=indent, **json_options) + "\n"
    write_bytes_atomic(path, text.encode(), mode=mode)


@contextmanager
def staged_dir(target: str | os.PathLike, *, replace: bool = True, staging_parent: str | os.PathLike | None = None,
               mode: int = 0o777) -> Iterator[Path]:
    """Build a directory and publish it as ``target`` in one step.

    Yields an empty staging directory (made with ``mode`` less the umask). When the block exits cleanly, every
    file and directory in it is flushed to disk and it is renamed to ``target``. With ``replace``, an existing
    ``target`` is renamed aside first and deleted after the swap; without, the rename refuses a non-empty
    ``target`` (:class:`SwapError`), so one writer never overwrites what another published. On any failure the
    staging directory is removed and ``target`` is as it was.

    :param staging_parent: where to stage, on the same file system; by default ``target``'s parent. Give one when a
        reader lists that directory and must never see a staging name there. Leftovers of crashed writers of the
        same name, older than :data:`STALE_STAGING_S`, are removed first.
    """
    target = Path(target)
    parent = Path(staging_parent or target.parent)
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent.glob(f".{target.name}.staging-*"))
    _remove_stale(target.parent.glob(f".{target.name}.retired-*"))
    token = uuid.uuid4().hex[:12]
    staging = parent / f".{target.name}.staging-{token}"
    staging.mkdir(mode=mode)
    try:
        yield staging
        _fsync_tree(staging)
        _swap(staging, target, target.parent / f".{target.name}.retired-{token}" if replace else None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk."""
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


def _swap(staging: Path, target: Path, retired: Path | None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    had_previous = retired is not None and target.exists()
    if had_previous:
        os.rename(target, retired)
    try:
        os.rename(staging, target)
    except OSError as exc:
        if had_previous:
            os.rename(retired, target)
        raise SwapError(exc.errno, exc.strerror, exc.filename, None, exc.filename2) from exc
    _fsync_dir(target.parent)
    if had_previous:
        shutil.rmtree(retired, ignore_errors=True)


def _remove_stale(leftovers: Iterable[Path]) -> None:
    now = time.time()
    for leftover in leftovers:
        try:
            if now - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            pass
