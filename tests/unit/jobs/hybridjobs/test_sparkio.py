"""hybridjobs.sparkio: a real Spark (local mode, this machine's JVM; its Python workers get hybridjobs as the jobs
ship it) writes and reads partitions on a POSIX root and on an S3 endpoint (moto's server in this process) through
pyarrow, with no Hadoop S3 connector. One session for the module: a JVM start is the expensive part."""

from __future__ import annotations

import datetime as dt

import pytest
from hybridjobs import objectstore, sparkio
from hybridjobs.objectstore import CorruptPart, PartitionNotPublished, StorageError, open_uri

pytest.importorskip("pyspark")


@pytest.fixture(params=["posix", "s3"])
def root(request, tmp_path):
    """A partition URI and the access that opens it."""
    if request.param == "posix":
        return str(tmp_path / "storage" / "features" / "ds=2026-07-17"), None
    bucket, access = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/prefix/features/ds=2026-07-17", access


def frame(spark, start: int, rows: int, slices: int = 3):
    when = dt.datetime(2026, 7, 17, 12, tzinfo=dt.UTC)
    data = [(f"c{i:04d}", i % 2, float(i) / 4, when + dt.timedelta(minutes=i)) for i in range(start, start + rows)]
    return spark.createDataFrame(data, "customer_id string, label int, score float, ts timestamp").repartition(
        slices)


def rows_of(df) -> list[tuple]:
    return sorted(tuple(row) for row in df.collect())


def test_a_partition_round_trips_through_the_store_one_part_per_task(spark, root):
    uri, access = root
    written = frame(spark, 0, 50)
    manifest = sparkio.write_partition(written, uri, {"dataset": "features"}, access=access)
    assert manifest["row_count"] == 50 and manifest["dataset"] == "features" and 1 <= len(manifest["parts"]) <= 3
    assert sum(part["rows"] for part in manifest["parts"]) == 50
    read = sparkio.read_partition(spark, uri, access=access)
    assert read.schema == written.schema
    assert rows_of(read) == rows_of(written)
    assert read.rdd.getNumPartitions() == len(manifest["parts"])
    assert sparkio.read_partition(spark, uri, columns=["label", "customer_id"], access=access).columns == [
        "label", "customer_id"]


def test_a_rerun_replaces_the_partition_and_an_empty_one_keeps_its_columns(spark, root):
    uri, access = root
    sparkio.write_partition(frame(spark, 0, 20), uri, access=access)
    sparkio.write_partition(frame(spark, 100, 5), uri, access=access)
    assert [row[0] for row in rows_of(sparkio.read_partition(spark, uri, access=access))] == [
        f"c{i:04d}" for i in range(100, 105)]
    empty = frame(spark, 0, 0)
    manifest = sparkio.write_partition(empty, uri, access=access)
    assert manifest["row_count"] == 0 and manifest["parts"] == []
    read = sparkio.read_partition(spark, uri, access=access)
    assert read.schema == empty.schema and read.count() == 0


def test_a_retried_task_writes_a_part_of_its_own_try_and_only_the_retry_is_published(spark, tmp_path):
    from pyspark import TaskContext

    def fail_first_try_of_task_0(batches):
        context = TaskContext.get()
        if context.partitionId() == 0 and context.attemptNumber() == 0:
            raise RuntimeError("executor lost (injected)")
        yield from batches

    written = frame(spark, 0, 30)
    uri = str(tmp_path / "retried")
    manifest = sparkio.write_partition(written.mapInArrow(fail_first_try_of_task_0, written.schema), uri)
    assert any(part["key"].endswith("part-00000-1.parquet") for part in manifest["parts"]), manifest["parts"]
    assert rows_of(sparkio.read_partition(spark, uri)) == rows_of(written)


def test_reading_what_is_not_published_or_not_whole_is_refused_naming_it(spark, root):
    uri, access = root
    with pytest.raises(PartitionNotPublished, match="ds=2026-07-17: not published"):
        sparkio.read_partition(spark, uri, access=access)
    manifest = sparkio.write_partition(frame(spark, 0, 40, slices=1), uri, access=access)
    with pytest.raises(StorageError, match=r"no column \['nope'\]"):
        sparkio.read_partition(spark, uri, columns=["nope"], access=access)
    part = open_uri(uri, access).child(manifest["parts"][0]["key"])
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(Exception, match="the manifest names") as refused:
        sparkio.read_partition(spark, uri, access=access).collect()
    assert CorruptPart.__name__ in str(refused.value)


def test_a_store_it_cannot_write_fails_before_any_task_runs_naming_the_uri(spark, s3_endpoint):
    access = objectstore.S3Access.from_environment({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                                                    "AWS_ENDPOINT_URL": s3_endpoint})
    jobs_before = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    with pytest.raises(StorageError, match="s3://no-such-bucket-here/features/ds=2026-07-17/_attempt=.*cannot write"):
        sparkio.write_partition(frame(spark, 0, 5), "s3://no-such-bucket-here/features/ds=2026-07-17", access=access)
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup()) == jobs_before
