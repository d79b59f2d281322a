"""The predictions contract every scoring path shares, Spark or not: the model (TorchScript, float32 [B, n_features]
in the features manifest's ``feature_columns`` order -> float32 [B, 1]), its per-process cache, the batch scorer,
and the predictions manifest. No Spark here: the Slurm (GPU) scorer runs in the cluster's job environment, which
has torch and pyarrow but no pyspark.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from hybridjobs import manifests, storage

DEFAULT_BATCH_SIZE = 65_536
PREDICTION_COLUMNS = ("customer_id", "score", "model_version")
# The partition's columns as its manifest declares them (the type names Spark's writer used), and the file schema
# every scoring path writes: model_version is on every row, so it is required.
COLUMNS = [{"name": "customer_id", "type": "string"}, {"name": "score", "type": "float32"},
           {"name": "model_version", "type": "string"}]
SCHEMA = pa.schema([pa.field("customer_id", pa.string()), pa.field("score", pa.float32()),
                    pa.field("model_version", pa.string(), nullable=False)])
_MODELS: dict[tuple[str, str], Any] = {}


class ModelContractError(ValueError):
    """The model does not take [B, n_features] float32 or does not return [B, 1] float32."""


def load_model(path: str, device: str = "cpu") -> Any:
    """The TorchScript module at ``path`` on ``device``, loaded once per process and device."""
    model = _MODELS.get((path, device))
    if model is None:
        import torch

        model = torch.jit.load(path, map_location=device)
        model.eval()
        _MODELS[(path, device)] = model
    return model


def batch_inputs(batch: Any, feature_columns: Sequence[str]) -> Any:
    """The model's float32 [B, n] input from an Arrow record batch, columns in ``feature_columns`` order (not
    the batch's); a null is NaN. Both scoring paths build their inputs here.

    One copy: float32 columns without nulls are read zero-copy and stacked into a C-contiguous [n, B] block,
    returned transposed (a view).
    """
    import numpy as np

    columns = [batch.column(name).to_numpy(zero_copy_only=False) for name in feature_columns]
    return np.stack(columns, dtype=np.float32).T


def score_array(model: Any, inputs: Any, device: str = "cpu") -> Any:
    """float32 [B, n] numpy -> float32 [B] numpy scores; raises ModelContractError on a wrong output shape."""
    import numpy as np
    import torch

    with torch.inference_mode():
        scores = model(torch.from_numpy(inputs).to(device, non_blocking=True))
    if tuple(scores.shape) != (len(inputs), 1):
        raise ModelContractError(f"model returned shape {tuple(scores.shape)} for input {inputs.shape}; "
                                 f"expected ({len(inputs)}, 1)")
    return scores.to("cpu").numpy().reshape(-1).astype(np.float32, copy=False)


def write_scored(writer: Any, model: Any, batches: Iterable[Any], feature_columns: Sequence[str],
                 model_version: str, device: str = "cpu") -> int:
    """Scores Arrow batches of features (``customer_id`` and ``feature_columns``) into ``writer`` (a Parquet
    writer of :data:`SCHEMA`), a row group per batch; returns the rows written. Every scoring path's loop."""
    version = pa.scalar(model_version, pa.string())
    rows = 0
    for batch in batches:
        scores = score_array(model, batch_inputs(batch, feature_columns), device)
        writer.write_batch(pa.record_batch(
            [pc.cast(batch.column("customer_id"), pa.string()), pa.array(scores, pa.float32()),
             pa.repeat(version, batch.num_rows)], schema=SCHEMA))
        rows += batch.num_rows
    return rows


def check_model(model_path: str, n_features: int, device: str = "cpu") -> None:
    """Fails fast, before any row is read, when the model does not fit the features manifest."""
    import torch

    model = load_model(model_path, device)
    try:
        with torch.inference_mode():
            out = model(torch.zeros(2, n_features, dtype=torch.float32, device=device))
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


def check_version(model_version: str) -> None:
    if not model_version.strip():
        raise ValueError("model_version must not be empty: every prediction row carries it")


def manifest(staging: Path, ds: str, features_manifest: dict[str, Any], columns: list[dict[str, str]],
             job: dict[str, Any], model_path: str, model_version: str) -> dict[str, Any]:
    """The predictions manifest of a staged partition, after checking its row count against the features
    manifest (a mismatch publishes nothing and leaves the staging directory for inspection)."""
    stats = manifests.column_stats(manifests.partition_files(staging), list(PREDICTION_COLUMNS), ["score"])
    rows = stats["row_count"]
    if rows != features_manifest["row_count"]:
        raise RuntimeError(f"scored {rows} rows but features/ds={ds} has {features_manifest['row_count']}: "
                           f"not publishing; the staging directory {staging} is left for inspection")
    built = storage.base_manifest("predictions", ds, rows, columns, job)
    built.update(
        model={"path": model_path, "version": model_version, "sha256": file_sha256(model_path)},
        feature_columns=list(features_manifest["feature_columns"]),
        features_manifest={"created_at": features_manifest.get("created_at"),
                           "row_count": features_manifest["row_count"]},
        null_ratio=stats["null_ratio"],
        nan_ratio=stats["nan_ratio"],
        score_stats=stats["feature_stats"]["score"],
        files=storage.data_files(staging),
    )
    return built
