"""Spark datasets on any storage URI, without Hadoop's S3 connector: the Python workers on the executors read and
write the Parquet parts through :mod:`hybridjobs.objectstore` (pyarrow), and the driver commits a written
partition by its manifest (the protocol in objectstore's docstring).

So a Spark with no ``s3a://`` jars (the local stack: no Maven here; Spark Connect and serverless Sparks that take
no jars) reads and writes ``s3://`` as it does a local path. Each Spark task writes its rows as one part; the
driver lists nothing: it learns the parts from the tasks' results, and a reader learns them from the manifest.

The store's keys travel to the executors inside the task closure (Spark's RPC), never on a command line, in the
Spark conf or in a log; an executor needs no AWS environment of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from hybridjobs import objectstore
from hybridjobs.objectstore import S3Access

PART_FIELDS = pa.schema([("key", pa.string()), ("bytes", pa.int64()), ("sha256", pa.string()),
                         ("rows", pa.int64()), ("table", pa.string())])
PART_ROW = "key string, bytes bigint, sha256 string, rows bigint, `table` string"


def access_for(uri: str) -> S3Access | None:
    """The driver's access to ``uri``'s store, resolved once and handed to every task (None: a local path)."""
    return S3Access.from_environment() if uri.startswith("s3://") else None


def write_partition(df: DataFrame, uri: str, fields: Mapping[str, Any] | None = None,
                    access: S3Access | None = None) -> dict[str, Any]:
    """Writes ``df`` as the partition at ``uri`` and publishes it (replacing an earlier one); returns its
    manifest. A task that writes no row writes no part; a job killed before its commit leaves the earlier
    partition as it was. A task holds its rows and their Parquet bytes in its Python worker's memory: size the
    Spark partitions to fit (``repartition`` before writing)."""
    access = access or access_for(uri)
    parts, schema = write_parts(df, uri, access)
    return objectstore.commit_partition(objectstore.open_uri(uri, access), parts, fields, schema=schema)


def write_parts(df: DataFrame, uri: str, access: S3Access | None = None,
                table_name: str | None = None) -> tuple[list[dict[str, Any]], pa.Schema]:
    """Writes ``df`` as parts of a new attempt at the partition ``uri`` (of its table ``table_name``), publishing
    nothing: the parts' manifest entries and their schema, for :func:`objectstore.commit_partition` (after the
    driver has read what it reports on, or written the partition's other tables)."""
    access = access or access_for(uri)
    attempt = objectstore.new_attempt()
    # A bad URI, a missing bucket, wrong keys or an endpoint that does not answer fail here, in seconds, before any
    # task runs (the probe lies in the attempt: the commit removes it).
    objectstore.open_uri(uri, access).child(f"{objectstore.ATTEMPT_PREFIX}{attempt}", "_writable").write_bytes(b"")
    schema = to_arrow_schema(df.schema, timezone="UTC")  # timestamps are instants: UTC, whatever the session's

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        batches = [batch for batch in batches if batch.num_rows]
        if batches:  # as Spark hands them (its string types may be the large ones): readers cast to the manifest's
            table = pa.Table.from_batches(batches)
            task = TaskContext.get()
            entry = objectstore.write_part(objectstore.open_uri(uri, access), attempt, task.partitionId(), table,
                                           task_try=task.attemptNumber(), table_name=table_name)
            yield pa.RecordBatch.from_pylist([{**entry, "table": table_name}], schema=PART_FIELDS)

    parts = [{key: value for key, value in row.asDict().items() if key != "table" or value}
             for row in df.mapInArrow(write, PART_ROW).collect()]
    return parts, schema


def read_partition(spark: SparkSession, uri: str, columns: list[str] | None = None,
                   access: S3Access | None = None, table_name: str | None = None) -> DataFrame:
    """The published partition at ``uri`` (its table ``table_name``, if it has several) as a DataFrame, one Spark
    partition per part, each part checked against its manifest entry where it is read.

    :raises objectstore.PartitionNotPublished: no ``_SUCCESS``, or a commit in progress.
    """
    access = access or access_for(uri)
    manifest = objectstore.read_manifest(objectstore.open_uri(uri, access))
    arrow_schema = objectstore.manifest_schema(manifest, table_name)
    if columns is not None:
        missing = [c for c in columns if c not in arrow_schema.names]
        if missing:
            raise objectstore.StorageError(f"{uri}: no column {missing} (it has {arrow_schema.names})")
        arrow_schema = pa.schema([arrow_schema.field(c) for c in columns])
    schema = from_arrow_schema(arrow_schema)
    parts = objectstore.parts_of(manifest, table_name)
    if not parts:
        return spark.createDataFrame([], schema)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        partition = objectstore.open_uri(uri, access)
        for batch in batches:
            for text in batch.column(0).to_pylist():
                table = objectstore.read_part(partition, json.loads(text), columns)
                yield from table.cast(arrow_schema).to_batches()

    # One slice per part, no shuffle: the parts are read where the tasks run, in parallel.
    listing = spark.sparkContext.parallelize([(json.dumps(part),) for part in parts], len(parts))
    return spark.createDataFrame(listing, "part string").mapInArrow(read, schema)
