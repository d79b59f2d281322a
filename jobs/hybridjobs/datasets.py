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

from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from hybridjobs import manifests, objectstore, sparkio, storage
from hybridjobs.layout import StorageLayout


def on_object_store(root: str) -> bool:
    return root.startswith("s3://")


def partition_uri(root: str, dataset: str, ds: str) -> str:
    return StorageLayout(root.rstrip("/")).partition(dataset, ds)


def is_published(root: str, dataset: str, ds: str) -> bool:
    uri = partition_uri(root, dataset, ds)
    if not on_object_store(root):
        return storage.is_published(uri)
    try:
        objectstore.read_manifest(objectstore.open_uri(uri, sparkio.access_for(uri)))
        return True
    except objectstore.PartitionNotPublished:
        return False


def read_table(spark: SparkSession, root: str, dataset: str, ds: str, columns: list[str],
               table_name: str | None = None) -> DataFrame:
    """``columns`` of a published partition (of its table ``table_name``)."""
    uri = partition_uri(root, dataset, ds)
    if on_object_store(root):
        return sparkio.read_partition(spark, uri, columns, table_name=table_name)
    return spark.read.parquet(f"{uri}/{table_name}" if table_name else uri).select(*columns)


def table_rows(root: str, dataset: str, ds: str, table_name: str | None = None) -> int:
    """Rows of a published partition (of its table ``table_name``): the manifest's parts, or the files' footers."""
    uri = partition_uri(root, dataset, ds)
    if on_object_store(root):
        manifest = objectstore.read_manifest(objectstore.open_uri(uri, sparkio.access_for(uri)))
        return sum(part["rows"] for part in objectstore.parts_of(manifest, table_name))
    return manifests.parquet_rows(manifests.partition_files(uri, table_name or ""))


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

    def publish(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return objectstore.commit_partition(objectstore.open_uri(self.uri, self.access), self.parts, manifest,
                                            schema=self.schema)


def output(root: str, dataset: str, ds: str) -> FolderOutput | ObjectStoreOutput:
    """Where a job writes a partition of ``dataset`` under ``root``, published by the job once it is whole."""
    return (ObjectStoreOutput if on_object_store(root) else FolderOutput)(root, dataset, ds)
