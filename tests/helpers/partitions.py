"""Published dataset partitions under a storage root (``<root>/<dataset>/ds=<ds>``), as the jobs leave them:
Parquet parts, ``_MANIFEST.json``, then ``_SUCCESS``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def manifest(root: Path, dataset: str, ds: str) -> dict:
    """The manifest of a published partition; fails when the partition is not published (no ``_SUCCESS``)."""
    part = root / dataset / f"ds={ds}"
    assert (part / "_SUCCESS").is_file(), f"{part} is not published"
    return json.loads((part / "_MANIFEST.json").read_text())


def read(root: Path, dataset: str, ds: str) -> pa.Table:
    """Every Parquet part of a partition, in file name order (staging and marker files left out)."""
    part = root / dataset / f"ds={ds}"
    files = sorted(p for p in part.glob("*.parquet") if not p.name.startswith((".", "_")))
    return pa.concat_tables([pq.read_table(f) for f in files])
