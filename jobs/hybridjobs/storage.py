"""The storage layout every stage shares, its manifests, and atomic publishing on a POSIX root.

Layout under a storage root (hybridjobs/layout.py): ``<root>/<dataset>/ds=YYYY-MM-DD/`` for the datasets
``raw``, ``features``, ``quarantine`` and ``predictions``. A partition is published when it holds
``_MANIFEST.json`` and, written after it, ``_SUCCESS``. Readers must ignore a partition without ``_SUCCESS``.

Publishing (hybridjobs/atomic.py): a job writes into a staging directory that is a hidden sibling of the target
(``.ds=<ds>.staging-<id>``, ignored by Spark and pyarrow because of the leading dot), writes the manifest and
the marker there, then renames it into place. An older partition is first renamed aside and deleted after the
swap, so a rerun of a ds replaces the partition and never mixes old and new files. Between the two renames
(microseconds) the partition is absent; a reader then sees "not published", never a half-written partition.
Renames are atomic on one POSIX file system (local disk, NFS, Lustre); object stores need a different
commit protocol (objectstore.py). The manifest is that protocol's all the same: every data file is a part with its
bytes, sha256 and rows, and ``_SUCCESS`` names the manifest's sha256, so a reader of either root follows one rule.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from hybridjobs.atomic import STALE_STAGING_S as STALE_STAGING_S
from hybridjobs.atomic import new_staging_dir as new_staging_dir
from hybridjobs.atomic import swap_in, write_json_atomic
from hybridjobs.layout import DATASETS, StorageLayout

MANIFEST_NAME = "_MANIFEST.json"
SUCCESS_NAME = "_SUCCESS"
FORMAT_VERSION = 1


class PartitionNotPublishedError(RuntimeError):
    """A stage's input partition has no ``_SUCCESS`` marker (missing, or its writer has not finished)."""


class ManifestError(ValueError):
    """A published partition's ``_MANIFEST.json`` is not JSON, or lacks a field its reader needs."""


def parse_ds(ds: str) -> date:
    """``YYYY-MM-DD`` -> date; anything else raises ValueError naming the expected form."""
    try:
        parsed = datetime.strptime(ds, "%Y-%m-%d").date()
    except (TypeError, ValueError):
        raise ValueError(f"ds must be a date as YYYY-MM-DD, got {ds!r}") from None
    if parsed.isoformat() != ds:
        raise ValueError(f"ds must be a date as YYYY-MM-DD, got {ds!r}")
    return parsed


def _day(ds: str | date) -> date:
    # a job parses its ds once and passes the date; text is parsed (and checked) here
    return ds if isinstance(ds, date) else parse_ds(ds)


def interval_end(ds: str | date) -> datetime:
    """The exclusive end of a daily partition's data interval: midnight UTC after ``ds``."""
    start = datetime.combine(_day(ds), datetime.min.time(), tzinfo=UTC)
    return start + timedelta(days=1)


def lookback_ds(ds: str | date, days: int) -> list[str]:
    """The ``days`` partitions ending at ``ds``, oldest first (``days=1`` is just ``ds``)."""
    if days < 1:
        raise ValueError(f"lookback days must be >= 1, got {days}")
    end = _day(ds)
    return [(end - timedelta(days=offset)).isoformat() for offset in range(days - 1, -1, -1)]


@dataclass(frozen=True)
class Partitions:
    """The partitions one job reads and writes: one layout for all of them. A ``ds`` is checked once, where the
    job takes it (``cli.ds_argument``, :func:`parse_ds` in the job's ``run``), not again at every path."""

    layout: StorageLayout

    @classmethod
    def under(cls, root: str | os.PathLike) -> Partitions:
        return cls(StorageLayout(os.fspath(root)))

    def dir(self, dataset: str, ds: str) -> Path:
        if dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
        return Path(self.layout.partition(dataset, ds))


def partition_dir(root: str | os.PathLike, dataset: str, ds: str) -> Path:
    """One partition's directory, ``ds`` checked too: for a caller with one path to find (a test, generate_raw)."""
    parse_ds(ds)
    return Partitions.under(root).dir(dataset, ds)


def is_published(partition: str | os.PathLike) -> bool:
    return (Path(partition) / SUCCESS_NAME).is_file()


def read_manifest(partition: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a published partition; raises PartitionNotPublishedError when there is no marker."""
    partition = Path(partition)
    if not is_published(partition):
        raise PartitionNotPublishedError(
            f"{partition} is not published (no {SUCCESS_NAME}): run the stage that writes it for this ds "
            "first"
        )
    try:
        manifest = json.loads((partition / MANIFEST_NAME).read_text())
    except ValueError as err:
        raise ManifestError(f"{partition / MANIFEST_NAME} is not JSON ({err}): republish the partition") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{partition / MANIFEST_NAME} is not a JSON object: republish the partition")
    return manifest


def read_features_manifest(partition: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a published features partition, with the fields every reader of features relies on
    checked: ``feature_columns`` (a non-empty list of names) and ``row_count`` (a count).

    :raises PartitionNotPublishedError: no ``_SUCCESS``.
    :raises ManifestError: naming each bad field and the fix.
    """
    return check_features_manifest(read_manifest(partition), Path(partition) / MANIFEST_NAME)


def check_features_manifest(manifest: dict[str, Any], where: str | os.PathLike) -> dict[str, Any]:
    """``manifest`` if it has ``feature_columns`` and ``row_count``; else ManifestError naming ``where``."""
    columns, rows = manifest.get("feature_columns"), manifest.get("row_count")
    problems = []
    if not isinstance(columns, list) or not columns or not all(isinstance(c, str) and c for c in columns):
        problems.append(f"feature_columns is {columns!r}, expected a non-empty list of column names")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        problems.append(f"row_count is {rows!r}, expected a count of rows >= 0")
    if problems:
        raise ManifestError(f"{where}: {'; '.join(problems)}: republish the partition "
                            "(jobs/build_features.py writes both)")
    return manifest


def publish(staging: str | os.PathLike, target: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """Writes the manifest (with every data file as a part: a data file in a subfolder belongs to the table the
    folder names), then ``_SUCCESS`` naming its sha256, into ``staging`` and swaps it in as ``target``. Returns the
    manifest as published."""
    staging, target = Path(staging), Path(target)
    if not staging.is_dir():
        raise FileNotFoundError(f"staging directory {staging} does not exist: nothing was written to publish")
    for leftover in staging.glob(SUCCESS_NAME):
        leftover.unlink()
    from hybridjobs import objectstore  # pyarrow: only a publishing job needs it, not every job's argument parsing

    folder = objectstore.open_uri(str(staging.absolute()))
    parts = [objectstore.file_part(folder, key, key.split("/")[0] if "/" in key else None)
             for key in data_files(staging) if key.endswith(".parquet")]
    published = {**manifest, "protocol": objectstore.PROTOCOL, "parts": parts}
    write_json_atomic(staging / MANIFEST_NAME, published, default=str)
    (staging / SUCCESS_NAME).write_bytes(objectstore.success_body((staging / MANIFEST_NAME).read_bytes()))
    swap_in(staging, target)
    return published


def data_files(partition: str | os.PathLike) -> list[str]:
    """Visible data files of a partition (what Spark and pyarrow read), relative and sorted."""
    partition = Path(partition)
    return sorted(
        str(p.relative_to(partition))
        for p in partition.rglob("*")
        if p.is_file() and not any(part.startswith(("_", ".")) for part in p.relative_to(partition).parts)
    )


def base_manifest(dataset: str, ds: str, row_count: int, columns: list[dict[str, str]],
                  job: dict[str, Any]) -> dict[str, Any]:
    """The keys every manifest has; stages add their own sections."""
    return {
        "dataset": dataset,
        "ds": ds,
        "format_version": FORMAT_VERSION,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "row_count": int(row_count),
        "columns": columns,
        "job": job,
    }
