"""Batch scoring on Spark: a TorchScript model over a features partition, scored and written by Spark tasks.

The model takes float32 [B, n_features] in the order of the features manifest's ``feature_columns`` and
returns float32 [B, 1] probabilities (the contract of ``hybridjobs.predictions``). Spark spreads the work over
its executors' Python workers (``mapInArrow`` over task ids) and retries failed tasks; each task reads its
Parquet row groups with pyarrow, scores them with torch and writes one predictions file with pyarrow.

Why the rows never pass through the JVM, measured with ``make bench BENCH=scoring`` (2M rows, 2 cores): Spark
reads the features fast (~1 s), but handing their 30 float columns to Python costs a columnar -> row -> Arrow
conversion of every value (4-5 s for the round trip; Spark 4.3 skips it only for Arrow-backed sources), and
writing the predictions through Spark costs another row conversion and its Parquet writer (~0.5 s). With
both in the tasks the job runs at 0.8-1.2x a plain single process (which reads, scores and writes one phase
after the other), against 0.2x for ``mapInPandas`` over Spark's reader and writer.

- ``assign_row_groups`` gives each core one task of whole row groups, balanced by rows: a task costs a Python
  worker ~0.1 s, and batches never span row groups.
- ``batch_inputs`` reads each feature column zero-copy and stacks the columns once into a [n, B] block whose
  transpose is the model's [B, n] input (torch's matmul takes it without another copy).
- One Python worker per core, so torch runs on one thread and pyarrow without its thread pool in each. Spark
  reuses its Python workers across tasks (``spark.python.worker.reuse``, on by default) and ``load_model``
  caches per process: one model load per worker.
- A task writes its part through a ``datasets.PartSink``: on a POSIX root ``part-<task>.parquet`` under a hidden
  temporary name, renamed when complete, so a retried or speculative attempt replaces the file whole; on an
  object store one PUT of the whole part under the job's attempt, which only the commit's manifest names. The job
  publishes only after every task succeeded and the row count matches the features manifest.
- The tasks read the features parts the manifest names (their footers planned on the driver), through pyarrow's
  filesystem for the root: ``s3://`` needs no Hadoop connector.

The model must be a path every executor reads (the local stack: the shared storage root).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from hybridjobs import datasets, manifests, objectstore, partitions, predictions, sparkio, storage
from hybridjobs.objectstore import S3Access
from hybridjobs.predictions import (
    COLUMNS,
    DEFAULT_BATCH_SIZE,
    SCHEMA,
    ModelContractError,
    batch_inputs,
    check_model,
    load_model,
)
from hybridjobs.spark import job_section

__all__ = ["COLUMNS", "DEFAULT_BATCH_SIZE", "SCHEMA", "ModelContractError", "assign_row_groups", "batch_inputs",
           "check_model", "load_model", "plan", "run", "score_tasks"]
# One row per task: its part's entry (bytes and sha256 only where the task hashed what it put: an object store).
WRITTEN_FIELDS = pa.schema([("key", pa.string()), ("rows", pa.int64()), ("bytes", pa.int64()),
                            ("sha256", pa.string())])
WRITTEN_SCHEMA = "key string, rows long, bytes long, sha256 string"
RowGroup = tuple[str, int]  # (Parquet file, row group index)


def assign_row_groups(row_groups: Sequence[tuple[str, int, int]], tasks: int) -> list[list[RowGroup]]:
    """(file, row group, rows) -> ``tasks`` lists of (file, row group), fewer when there are fewer row groups
    (but always one), balanced by rows: each row group, largest first, goes to the task with the fewest rows."""
    loads: list[tuple[int, list[RowGroup]]] = [(0, []) for _ in range(max(1, min(tasks, len(row_groups))))]
    for path, index, rows in sorted(row_groups, key=lambda group: -group[2]):
        lightest = min(range(len(loads)), key=lambda task: loads[task][0])
        total, assigned = loads[lightest]
        loads[lightest] = (total + rows, [*assigned, (path, index)])
    return [sorted(assigned) for _, assigned in loads]


def score_tasks(task_ids: Iterator[pa.RecordBatch], tasks: Sequence[Sequence[RowGroup]], sink: datasets.PartSink,
                model_path: str, feature_columns: Sequence[str], model_version: str, batch_size: int,
                features_uri: str | None = None, access: S3Access | None = None) -> Iterator[pa.RecordBatch]:
    """mapInArrow body over task ids: scores each task's row groups (paths in the filesystem of
    ``features_uri``; local paths without one) into part ``<task>`` of ``sink`` and yields its entry."""
    import torch
    from pyspark import TaskContext

    torch.set_num_threads(1)  # Spark already runs one Python worker per core
    model = load_model(model_path)
    filesystem = objectstore.open_uri(features_uri, access).filesystem if features_uri else pafs.LocalFileSystem()
    columns = ["customer_id", *feature_columns]
    context = TaskContext.get()
    task_try = context.attemptNumber() if context else 0
    for ids in task_ids:
        for task in ids.column(0).to_pylist():
            def fill(writer: pq.ParquetWriter, row_groups: Sequence[RowGroup] = tasks[task]) -> int:
                rows = 0
                for path, index in row_groups:
                    # use_threads=False: the other cores run the other tasks
                    batches = pq.ParquetFile(filesystem.open_input_file(path)).iter_batches(
                        batch_size, row_groups=[index], columns=columns, use_threads=False)
                    rows += predictions.write_scored(writer, model, batches, feature_columns, model_version)
                return rows

            entry = sink.write(task, SCHEMA, fill, task_try)
            yield pa.RecordBatch.from_pylist([{field.name: entry.get(field.name) for field in WRITTEN_FIELDS}],
                                             schema=WRITTEN_FIELDS)


def plan(features: str | Path, parallelism: int, parts: Sequence[dict[str, Any]] | None = None,
         access: S3Access | None = None) -> list[list[RowGroup]]:
    """The tasks of a features partition, from the footers of the parts its manifest names (of its files, for a
    partition published before manifests named their parts)."""
    partition = objectstore.open_uri(str(features), access)
    paths = ([f"{partition.path}/{part['key']}" for part in parts] if parts is not None
             else [str(path) for path in manifests.partition_files(partition.path)])
    row_groups = []
    for path in paths:
        metadata = pq.ParquetFile(partition.filesystem.open_input_file(path)).metadata
        row_groups += [(path, i, metadata.row_group(i).num_rows) for i in range(metadata.num_row_groups)]
    return assign_row_groups(row_groups, parallelism)


def run(spark: SparkSession, root: str, ds: str, model_path: str, model_version: str,
        batch_size: int = DEFAULT_BATCH_SIZE) -> dict[str, Any]:
    """Scores ``features/ds=<ds>`` and publishes ``predictions/ds=<ds>`` under ``root`` (a local path or
    ``s3://bucket/prefix``); returns the predictions manifest."""
    predictions.check_version(model_version)
    started = time.monotonic()
    storage.parse_ds(ds)  # checked once, before any path is built from it
    features_uri = partitions.partition_uri(root, "features", ds)
    access = sparkio.access_for(features_uri)
    features_manifest = partitions.read_features_manifest(root, ds)
    feature_columns = list(features_manifest["feature_columns"])
    check_model(model_path, len(feature_columns))

    out = datasets.output(root, "predictions", ds)
    tasks = plan(features_uri, spark.sparkContext.defaultParallelism, features_manifest.get("parts"), access)
    scorer = partial(score_tasks, tasks=tasks, sink=out.part_sink(), model_path=model_path,
                     feature_columns=tuple(feature_columns), model_version=model_version, batch_size=batch_size,
                     features_uri=features_uri, access=access)
    written = spark.range(len(tasks), numPartitions=len(tasks)).mapInArrow(scorer, WRITTEN_SCHEMA).collect()
    out.written([{key: value for key, value in row.asDict().items() if value is not None} for row in written],
                SCHEMA)

    # the Spark route scores on CPUs, where bf16 gains nothing: float32 whatever the export's check allowed
    job = job_section(spark, "score_batch", started, features_manifest["row_count"], batch_size=batch_size,
                      precision="fp32")
    manifest = predictions.manifest_of(out.read, out.rows(), out.files(), out.where, ds,
                                       features_manifest, COLUMNS, job, model_path, model_version)
    return out.publish(manifest)
