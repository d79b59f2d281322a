"""Batch scoring: a TorchScript model over a features partition, Arrow batches through ``mapInPandas``.

The model takes float32 [B, n_features] in the order of the features manifest's ``feature_columns`` and
returns float32 [B, 1] probabilities. Each Python worker loads it once (``_MODELS``, keyed by path; Spark
reuses its workers across tasks) and runs torch on one thread: Spark already runs one worker per core. The
model path must be readable from the executors (the shared storage).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from hybridjobs import manifests, storage
from hybridjobs.spark import manifest_columns

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_BATCH_SIZE = 65_536
PREDICTION_SCHEMA = "customer_id string, score float"
_MODELS: dict[str, Any] = {}


class ModelContractError(ValueError):
    """The model does not take [B, n_features] float32 or does not return [B, 1] float32."""


def load_model(path: str) -> Any:
    """The TorchScript module at ``path``, loaded once per process."""
    model = _MODELS.get(path)
    if model is None:
        import torch

        torch.set_num_threads(1)
        model = torch.jit.load(path, map_location="cpu")
        model.eval()
        _MODELS[path] = model
    return model


def score_frames(frames: Iterator[pd.DataFrame], model_path: str,
                 feature_columns: Sequence[str]) -> Iterator[pd.DataFrame]:
    """mapInPandas body: one output frame (customer_id, score) per Arrow batch."""
    import numpy as np
    import pandas as pd
    import torch

    torch.set_num_threads(1)
    model = load_model(model_path)
    columns = list(feature_columns)
    for frame in frames:
        inputs = np.ascontiguousarray(frame[columns].to_numpy(dtype=np.float32))
        with torch.inference_mode():
            scores = model(torch.from_numpy(inputs))
        if tuple(scores.shape) != (len(inputs), 1):
            raise ModelContractError(f"model returned shape {tuple(scores.shape)} for input {inputs.shape}; "
                                     f"expected ({len(inputs)}, 1)")
        yield pd.DataFrame({"customer_id": frame["customer_id"].to_numpy(),
                            "score": scores.numpy().reshape(-1).astype(np.float32, copy=False)})


def check_model(model_path: str, n_features: int) -> None:
    """Fails fast on the driver when the model does not fit the features manifest."""
    import torch

    model = load_model(model_path)
    try:
        with torch.inference_mode():
            out = model(torch.zeros(2, n_features, dtype=torch.float32))
    except Exception as err:  # TorchScript raises RuntimeError subclasses with the shapes in the text
        raise ModelContractError(
            f"model {model_path} cannot score [B, {n_features}] float32 (the features manifest lists "
            f"{n_features} feature_columns): {err}"
        ) from err
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, 1) or out.dtype != torch.float32:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelContractError(f"model {model_path} must return float32 [B, 1]; for B=2 it returned {got}")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_bytes(total_bytes: int, parallelism: int) -> int:
    """Input split size that gives every core at least two tasks when the files allow it (128 MiB cap)."""
    return int(min(128 << 20, max(4 << 20, total_bytes // (2 * max(1, parallelism)))))


def run(spark: SparkSession, root: str, ds: str, model_path: str, model_version: str,
        batch_size: int = DEFAULT_BATCH_SIZE) -> dict[str, Any]:
    """Scores ``features/ds=<ds>`` and publishes ``predictions/ds=<ds>``; returns the predictions manifest."""
    if not model_version.strip():
        raise ValueError("model_version must not be empty: every prediction row carries it")
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

    stats = manifests.column_stats(manifests.partition_files(staging),
                                   ["customer_id", "score", "model_version"], ["score"])
    rows = stats["row_count"]
    if rows != features_manifest["row_count"]:
        raise RuntimeError(f"scored {rows} rows but features/ds={ds} has {features_manifest['row_count']}: "
                           "not publishing; the staging directory is left for inspection")
    seconds = round(time.monotonic() - started, 3)
    job = {
        "name": "score_batch",
        "spark_master": spark.sparkContext.master,
        "spark_app_id": spark.sparkContext.applicationId,
        "seconds": seconds,
        "rows_per_s": round(rows / seconds, 1) if seconds else None,
        "batch_size": batch_size,
    }
    manifest = storage.base_manifest("predictions", ds, rows, manifest_columns(scored), job)
    manifest.update(
        model={"path": model_path, "version": model_version, "sha256": file_sha256(model_path)},
        feature_columns=feature_columns,
        features_manifest={"created_at": features_manifest.get("created_at"),
                           "row_count": features_manifest["row_count"]},
        null_ratio=stats["null_ratio"],
        nan_ratio=stats["nan_ratio"],
        score_stats=stats["feature_stats"]["score"],
        files=storage.data_files(staging),
    )
    storage.publish(staging, target, manifest)
    return manifest
