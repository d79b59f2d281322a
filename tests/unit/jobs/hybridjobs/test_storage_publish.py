"""Partition layout, manifests and atomic publishing (hybridjobs.storage)."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridjobs import objectstore, storage


@pytest.mark.parametrize("ds, ok", [
    ("2026-01-05", True), ("2024-02-29", True), ("2026-1-5", False), ("2026-02-30", False),
    ("20260105", False), ("", False), ("2026-01-05T00:00", False), (None, False),
])
def test_parse_ds(ds, ok):
    if ok:
        assert storage.parse_ds(ds).isoformat() == ds
    else:
        with pytest.raises(ValueError, match="YYYY-MM-DD"):
            storage.parse_ds(ds)


def test_interval_end_is_next_midnight_utc():
    assert storage.interval_end("2025-12-31") == datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("days, expected", [
    (1, ["2026-01-05"]),
    (3, ["2026-01-03", "2026-01-04", "2026-01-05"]),
])
def test_lookback_ds_oldest_first(days, expected):
    assert storage.lookback_ds("2026-01-05", days) == expected


def test_lookback_ds_crosses_year_and_rejects_zero():
    assert storage.lookback_ds("2026-01-01", 2) == ["2025-12-31", "2026-01-01"]
    with pytest.raises(ValueError):
        storage.lookback_ds("2026-01-01", 0)


def test_partition_dir_layout_and_unknown_dataset(tmp_path):
    expected = tmp_path / "features" / "ds=2026-01-05"
    assert storage.partition_dir(tmp_path, "features", "2026-01-05") == expected
    with pytest.raises(ValueError, match="dataset"):
        storage.partition_dir(tmp_path, "feature", "2026-01-05")


@pytest.mark.parametrize(("dataset", "ds", "relative"), [
    ("raw", "2026-01-05", "raw/ds=2026-01-05"),
    ("features", "2024-02-29", "features/ds=2024-02-29"),
    ("quarantine", "2026-01-05", "quarantine/ds=2026-01-05"),
    ("predictions", "2025-12-31", "predictions/ds=2025-12-31"),
])
def test_a_jobs_partitions_are_partition_dirs(tmp_path, dataset, ds, relative):
    """One Partitions per job names what partition_dir names, without checking its ds again at each path."""
    assert storage.Partitions.under(tmp_path).dir(dataset, ds) == storage.partition_dir(tmp_path, dataset, ds)
    assert storage.Partitions.under(str(tmp_path)).dir(dataset, ds) == tmp_path / relative


def test_a_jobs_partitions_refuse_an_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="dataset must be one of"):
        storage.Partitions.under(tmp_path).dir("feature", "2026-01-05")


@pytest.mark.parametrize("ds", ["2026-01-05", "2024-02-29"])
def test_a_parsed_ds_gives_what_its_text_gives(ds):
    day = storage.parse_ds(ds)
    assert storage.interval_end(day) == storage.interval_end(ds)
    assert storage.lookback_ds(day, 3) == storage.lookback_ds(ds, 3)


def _stage(target, files):
    """A staging folder of ``files``: a ``.parquet`` name gets a Parquet file with one row holding its text."""
    staging = storage.new_staging_dir(target)
    staging.mkdir()
    for name, text in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"text": [text]}), staging / name)
        else:
            (staging / name).write_text(text)
    return staging


def _fields(manifest):
    """The manifest less what publishing adds (the parts, the protocol)."""
    return {key: value for key, value in manifest.items() if key not in ("parts", "protocol")}


def test_publish_writes_manifest_then_success_and_renames(tmp_path):
    target = storage.partition_dir(tmp_path, "raw", "2026-01-05")
    staging = _stage(target, {"events/part-0.parquet": "a"})
    assert staging.parent == target.parent and staging.name.startswith(".")
    storage.publish(staging, target, {"row_count": 1})
    assert not staging.exists()
    assert storage.is_published(target)
    assert _fields(storage.read_manifest(target)) == {"row_count": 1}
    # _SUCCESS is created after the manifest is complete, and names it.
    assert (target / "_SUCCESS").stat().st_mtime_ns >= (target / "_MANIFEST.json").stat().st_mtime_ns
    assert json.loads((target / "_SUCCESS").read_text())["manifest_sha256"] == objectstore.sha256_hex(
        (target / "_MANIFEST.json").read_bytes())


def test_publish_names_every_part_as_an_object_store_commit_does(tmp_path):
    target = storage.partition_dir(tmp_path, "raw", "2026-01-05")
    staging = _stage(target, {"events/part-0.parquet": "a", "events/part-1.parquet": "b",
                              "labels/part-0.parquet": "c", "events/.part-0.parquet.crc": "spark's"})
    data = {name: (staging / name).read_bytes() for name in ("events/part-0.parquet", "labels/part-0.parquet")}
    storage.publish(staging, target, {"row_count": 2})
    manifest = storage.read_manifest(target)
    assert manifest["protocol"] == objectstore.PROTOCOL
    assert [(part["key"], part.get("table"), part["rows"]) for part in manifest["parts"]] == [
        ("events/part-0.parquet", "events", 1), ("events/part-1.parquet", "events", 1),
        ("labels/part-0.parquet", "labels", 1)]
    assert manifest["parts"][0]["sha256"] == objectstore.sha256_hex(data["events/part-0.parquet"])
    assert manifest["parts"][2]["bytes"] == len(data["labels/part-0.parquet"])
    # One reader for both roots: the object store's reads the POSIX partition, table by table, every part checked.
    partition = objectstore.open_uri(str(target))
    assert objectstore.read_manifest(partition) == manifest
    assert objectstore.read_partition(partition, table_name="events").column("text").to_pylist() == ["a", "b"]
    assert objectstore.read_partition(partition, table_name="labels").column("text").to_pylist() == ["c"]


def test_publish_refuses_a_data_file_that_is_not_parquet_and_keeps_the_older_partition(tmp_path):
    target = storage.partition_dir(tmp_path, "features", "2026-01-05")
    storage.publish(_stage(target, {"part-old.parquet": "old"}), target, {"v": 1})
    staging = _stage(target, {"part-0.parquet": "x"})
    (staging / "part-1.parquet").write_text("not parquet")
    with pytest.raises(objectstore.StorageError, match="part-1.parquet: cannot read it as Parquet"):
        storage.publish(staging, target, {"v": 2})
    assert _fields(storage.read_manifest(target)) == {"v": 1}


def test_publish_replaces_an_older_partition_entirely(tmp_path):
    target = storage.partition_dir(tmp_path, "features", "2026-01-05")
    storage.publish(_stage(target, {"part-old.parquet": "old", "part-old2.parquet": "old"}), target, {"v": 1})
    storage.publish(_stage(target, {"part-new.parquet": "new"}), target, {"v": 2})
    assert storage.data_files(target) == ["part-new.parquet"]
    assert _fields(storage.read_manifest(target)) == {"v": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["ds=2026-01-05"]


def test_publish_keeps_the_older_partition_when_staging_is_missing(tmp_path):
    target = storage.partition_dir(tmp_path, "features", "2026-01-05")
    storage.publish(_stage(target, {"part-old.parquet": "old"}), target, {"v": 1})
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        storage.publish(target.parent / ".missing", target, {"v": 2})
    assert _fields(storage.read_manifest(target)) == {"v": 1}


def test_publish_drops_a_success_marker_written_by_spark_into_staging(tmp_path):
    target = storage.partition_dir(tmp_path, "predictions", "2026-01-05")
    staging = _stage(target, {"_SUCCESS": "", "part-0.parquet": "x"})
    storage.publish(staging, target, {"v": 1})
    assert _fields(json.loads((target / "_MANIFEST.json").read_text())) == {"v": 1}
    assert storage.is_published(target)


def test_read_manifest_of_an_unpublished_partition_says_what_to_run(tmp_path):
    target = storage.partition_dir(tmp_path, "features", "2026-01-05")
    target.mkdir(parents=True)
    (target / "_MANIFEST.json").write_text("{}")
    with pytest.raises(storage.PartitionNotPublishedError, match="no _SUCCESS"):
        storage.read_manifest(target)


def test_stale_staging_is_removed_but_a_recent_one_is_kept(tmp_path):
    target = storage.partition_dir(tmp_path, "features", "2026-01-05")
    stale = _stage(target, {"part-0.parquet": "x"})
    recent = _stage(target, {"part-0.parquet": "y"})
    old = time.time() - storage.STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    storage.new_staging_dir(target)
    assert not stale.exists()
    assert recent.exists()


def test_data_files_skip_hidden_and_marker_files(tmp_path):
    (tmp_path / "events").mkdir()
    for name in ("events/part-1.parquet", "events/.part-1.parquet.crc", "_SUCCESS", "_MANIFEST.json",
                 "part-0.parquet"):
        (tmp_path / name).write_text("")
    assert storage.data_files(tmp_path) == ["events/part-1.parquet", "part-0.parquet"]


def test_base_manifest_has_the_shared_keys():
    m = storage.base_manifest("features", "2026-01-05", 3, [{"name": "a", "type": "float32"}], {"name": "j"})
    assert {"dataset", "ds", "format_version", "created_at", "row_count", "columns", "job"} <= set(m)
    assert m["row_count"] == 3 and m["format_version"] == storage.FORMAT_VERSION
