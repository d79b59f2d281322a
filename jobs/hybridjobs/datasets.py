"""A Spark job's dataset partitions on either kind of storage root, behind one small interface.

- A POSIX root (a path every side mounts): Spark's own Parquet reader and writer; an output is written into a
  hidden staging folder and renamed into place (storage.py).
- An object store (``s3://bucket/prefix``): the Python workers read and write the parts through pyarrow
  (sparkio.py, no Hadoop S3 connector needed) and the driver commits the partition by its manifest
  (objectstore.py).

Either way the published manifest names every part with its bytes and sha256. A partition may hold several tables
(raw: ``events`` and ``labels``, a folder each on POSIX).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession

from hybridjobs import manifests, objectstore, sparkio, storage
from hybridjobs.objectstore import S3Access
from hybridjobs.partitions import on_object_store, partition_uri


def read_table(spark: SparkSession, root: str, dataset: str, ds: str, columns: list[str],
               table_name: str | None = None) -> DataFrame:
    """``columns`` of a published partition (of its table ``table_name``)."""
    uri = partition_uri(root, dataset, ds)
    if on_object_store(root):
        return sparkio.read_partition(spark, uri, columns, table_name=table_name)
    return spark.read.parquet(f"{uri}/{table_name}" if table_name else uri).select(*columns)


@dataclass(frozen=True)
class PartSink:
    """Where one Spark task writes a Parquet part itself (the scoring job streams its rows through a
    ``ParquetWriter``): a POSIX staging folder, the part renamed in whole when complete, or an attempt of an
    object-store partition, the part put in one request. Travels to the executors in the task closure."""

    staging: str | None = None
    uri: str | None = None
    attempt: str | None = None
    access: S3Access | None = None

    def write(self, index: int, schema: pa.Schema, fill: Callable[[pq.ParquetWriter], int],
              task_try: int = 0) -> dict[str, Any]:
        """Part ``index``: ``fill(writer)`` writes its rows and returns how many. Returns its entry (``key``,
        ``rows``, and on an object store ``bytes`` and ``sha256``)."""
        if self.staging is not None:
            target = Path(self.staging) / f"part-{index:05d}.parquet"
            partial = target.with_name(f".{target.name}.{os.getpid()}")  # a retried try replaces the part whole
            with pq.ParquetWriter(partial, schema) as writer:  # no row group: still a file with the schema
                rows = fill(writer)
            partial.replace(target)
            return {"key": target.name, "rows": rows}
        buffer = pa.BufferOutputStream()
        with pq.ParquetWriter(buffer, schema) as writer:
            rows = fill(writer)
        data = buffer.getvalue().to_pybytes()
        key = objectstore.part_key(self.attempt, index, task_try)
        objectstore.open_uri(self.uri, self.access).child(key).write_bytes(data)
        return objectstore.part_entry(key, data, rows)


class FolderOutput:
    """A partition on a POSIX root: Spark's writer into a hidden staging folder, renamed into place when
    published."""

    def __init__(self, root: str, dataset: str, ds: str) -> None:
        self.target = Path(partition_uri(root, dataset, ds))
        self.staging = storage.new_staging_dir(self.target)

    def write(self, df: DataFrame) -> None:
        df.write.parquet(str(self.staging))

    def rows(self) -> int:
        return manifests.parquet_rows(manifests.partition_files(self.staging))

    def read(self, columns: list[str]) -> pa.Table:
        return manifests.read_files(manifests.partition_files(self.staging), columns)

    def files(self) -> list[str]:
        return storage.data_files(self.staging)

    @property
    def where(self) -> str:
        return f"the staging directory {self.staging}"

    def part_sink(self) -> PartSink:
        self.staging.mkdir(parents=True, exist_ok=True)
        return PartSink(staging=str(self.staging))

    def written(self, entries: list[dict[str, Any]], schema: pa.Schema) -> None:
        """The parts the tasks wrote are the staging folder's files; a killed try's partial file goes."""
        for leftover in self.staging.glob(".part-*"):
            leftover.unlink()

    def publish(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return storage.publish(self.staging, self.target, manifest)


class ObjectStoreOutput:
    """A partition on an object store: parts of one attempt, committed by their manifest when published."""

    def __init__(self, root: str, dataset: str, ds: str) -> None:
        self.uri = partition_uri(root, dataset, ds)
        self.access = sparkio.access_for(self.uri)
        self.parts: list[dict[str, Any]] = []
        self.schema: pa.Schema | None = None
        self._written: pa.Table | None = None

    def write(self, df: DataFrame) -> None:
        self.parts, self.schema = sparkio.write_parts(df, self.uri, self.access)
        self._written = None

    def rows(self) -> int:
        return sum(part["rows"] for part in self.parts)

    def read(self, columns: list[str]) -> pa.Table:
        """What was written, fetched once to the driver (the outputs a manifest describes are small: features,
        quarantine), each part checked."""
        if self._written is None:
            partition = objectstore.open_uri(self.uri, self.access)
            tables = [objectstore.read_part(partition, part) for part in self.parts]
            self._written = (pa.concat_tables(tables, promote_options="permissive") if tables
                             else self.schema.empty_table())
        return self._written.select(columns)

    def files(self) -> list[str]:
        return sorted(part["key"] for part in self.parts)

    @property
    def where(self) -> str:
        return f"the uncommitted parts under {self.uri} (the next commit there removes them)"

    def part_sink(self) -> PartSink:
        attempt = objectstore.new_attempt()
        # A bad URI, a missing bucket, wrong keys or a dead endpoint fail here, before any task runs.
        objectstore.open_uri(self.uri, self.access).child(f"{objectstore.ATTEMPT_PREFIX}{attempt}",
                                                          "_writable").write_bytes(b"")
        return PartSink(uri=self.uri, attempt=attempt, access=self.access)

    def written(self, entries: list[dict[str, Any]], schema: pa.Schema) -> None:
        """The parts the tasks wrote, as their entries say (one per task; a killed try's is no entry's)."""
        self.parts, self.schema, self._written = [dict(entry) for entry in entries], schema, None

    def publish(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return objectstore.commit_partition(objectstore.open_uri(self.uri, self.access), self.parts, manifest,
                                            schema=self.schema)


def output(root: str, dataset: str, ds: str) -> FolderOutput | ObjectStoreOutput:
    """Where a job writes a partition of ``dataset`` under ``root``, published by the job once it is whole."""
    return (ObjectStoreOutput if on_object_store(root) else FolderOutput)(root, dataset, ds)
