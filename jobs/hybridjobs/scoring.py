"""Batch scoring: a TorchScript model over a features partition, Arrow batches through ``mapInPandas``.

The model takes float32 [B, n_features] in the order of the features manifest's ``feature_columns`` and
returns float32 [B, 1] probabilities. Each Python worker loads it once (``_MODELS``, keyed by path; Spark
reuses its workers across tasks) and runs torch on one thread: Spark already runs one worker per core. The
model path must be readable from the executors (the shared storage).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from hybridjobs import predictions, storage
from hybridjobs.predictions import DEFAULT_BATCH_SIZE, ModelContractError, check_model, load_model
from hybridjobs.spark import manifest_columns

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DEFAULT_BATCH_SIZE", "ModelContractError", "check_model", "load_model", "run", "score_frames"]
PREDICTION_SCHEMA = "customer_id string, score float"


def score_frames(frames: Iterator[pd.DataFrame], model_path: str,
                 feature_columns: Sequence[str]) -> Iterator[pd.DataFrame]:
    """mapInPandas body: one output frame (customer_id, score) per Arrow batch."""
    import numpy as np
    import pandas as pd
    import torch

    torch.set_num_threads(1)  # Spark already runs one Python worker per core
    model = load_model(model_path)
    columns = list(feature_columns)
    for frame in frames:
        inputs = np.ascontiguousarray(frame[columns].to_numpy(dtype=np.float32))
        yield pd.DataFrame({"customer_id": frame["customer_id"].to_numpy(),
                            "score": predictions.score_array(model, inputs)})


def split_bytes(total_bytes: int, parallelism: int) -> int:
    """Input split size that gives every core at least two tasks when the files allow it (128 MiB cap)."""
    return int(min(128 << 20, max(4 << 20, total_bytes // (2 * max(1, parallelism)))))


def run(spark: SparkSession, root: str, ds: str, model_path: str, model_version: str,
        batch_size: int = DEFAULT_BATCH_SIZE) -> dict[str, Any]:
    """Scores ``features/ds=<ds>`` and publishes ``predictions/ds=<ds>``; returns the predictions manifest."""
    predictions.check_version(model_version)
    started = time.monotonic()
    features_dir = storage.partition_dir(root, "features", ds)
    features_manifest = storage.read_manifest(features_dir)
    feature_columns = list(features_manifest["feature_columns"])
    check_model(model_path, len(feature_columns))

    input_bytes = sum((features_dir / f).stat().st_size for f in storage.data_files(features_dir))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(batch_size))
    spark.conf.set("spark.sql.files.maxPartitionBytes",
                   str(split_bytes(input_bytes, spark.sparkContext.defaultParallelism)))

    target = storage.partition_dir(root, "predictions", ds)
    staging = storage.new_staging_dir(target)
    features = spark.read.parquet(str(features_dir)).select("customer_id", *feature_columns)
    scorer = partial(score_frames, model_path=model_path, feature_columns=tuple(feature_columns))
    scored = features.mapInPandas(scorer, PREDICTION_SCHEMA).withColumn("model_version", F.lit(model_version))
    scored.write.parquet(str(staging))

    rows = features_manifest["row_count"]  # checked against the staged files by predictions.manifest
    seconds = round(time.monotonic() - started, 3)
    job = {
        "name": "score_batch",
        "spark_master": spark.sparkContext.master,
        "spark_app_id": spark.sparkContext.applicationId,
        "seconds": seconds,
        "rows_per_s": round(rows / seconds, 1) if seconds else None,
        "batch_size": batch_size,
    }
    manifest = predictions.manifest(staging, ds, features_manifest, manifest_columns(scored), job, model_path,
                                    model_version)
    storage.publish(staging, target, manifest)
    return manifest
