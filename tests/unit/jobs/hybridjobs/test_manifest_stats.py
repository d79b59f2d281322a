"""Manifest figures computed with pyarrow from written Parquet (hybridjobs.manifests)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridjobs import manifests


@pytest.fixture
def files(tmp_path):
    parts = [
        pa.table({"id": ["a", None], "x": pa.array([1.0, float("nan")], pa.float32()),
                  "y": pa.array([None, 2.0], pa.float64())}),
        pa.table({"id": ["c", "d"], "x": pa.array([3.0, -1.0], pa.float32()),
                  "y": pa.array([4.0, 6.0], pa.float64())}),
    ]
    paths = []
    for i, table in enumerate(parts):
        pq.write_table(table, tmp_path / f"part-{i}.parquet")
        paths.append(tmp_path / f"part-{i}.parquet")
    (tmp_path / ".part-0.parquet.crc").write_text("")
    (tmp_path / "_SUCCESS").write_text("")
    return paths


def test_partition_files_and_footer_row_count(files):
    assert manifests.partition_files(files[0].parent) == files
    assert manifests.parquet_rows(files) == 4


def test_column_stats_null_nan_and_bounds(files):
    stats = manifests.column_stats(files, ["id", "x", "y"], ["x", "y"])
    assert stats["row_count"] == 4
    assert stats["null_ratio"] == {"id": 0.25, "x": 0.0, "y": 0.25}
    assert stats["nan_ratio"] == {"x": 0.25, "y": 0.0}
    assert stats["feature_stats"]["x"] == {"min": -1.0, "mean": 1.0, "max": 3.0}
    assert stats["feature_stats"]["y"] == {"min": 2.0, "mean": 4.0, "max": 6.0}


def test_column_stats_of_no_rows():
    stats = manifests.column_stats([], ["x"], ["x"])
    assert stats["row_count"] == 0 and stats["null_ratio"] == {"x": 0.0}
    assert stats["feature_stats"]["x"] == {"min": None, "mean": None, "max": None}


def test_count_by_fills_zeros_and_rejects_unknown_values():
    table = pa.table({"reason": ["b", "a", "b"]})
    assert manifests.count_by(table, "reason", ["a", "b", "c"]) == {"a": 1, "b": 2, "c": 0}
    assert manifests.count_by(pa.table({}), "reason", ["a"]) == {"a": 0}
    with pytest.raises(ValueError, match=r"values \['z'\] outside"):
        manifests.count_by(pa.table({"reason": ["z"]}), "reason", ["a"])
