"""The predictions contract every scoring path shares, Spark or not: the model (TorchScript, float32 [B, n_features]
in the features manifest's ``feature_columns`` order -> float32 [B, 1]), its per-process cache, the batch scorer,
and the predictions manifest. No Spark here: the Slurm (GPU) scorer runs in the cluster's job environment, which
has torch and pyarrow but no pyspark.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from hybridjobs import manifests, storage

DEFAULT_BATCH_SIZE = 65_536
# fp32: the model as exported; bf16: its matrix products under bf16 autocast (standardisation and the sigmoid stay
# float32), only where the export's check allowed it (signature.json "precision").
PRECISIONS = ("fp32", "bf16")
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


def _forward(model: Any, inputs: Any, device: str, precision: str) -> Any:
    """The model's [B] float32 scores of a host float32 [B, n] tensor, still on ``device``."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    with torch.inference_mode(), torch.autocast(torch.device(device).type, torch.bfloat16,
                                                enabled=precision == "bf16"):
        scores = model(inputs.to(device, non_blocking=True))
    if tuple(scores.shape) != (len(inputs), 1):
        raise ModelContractError(f"model returned shape {tuple(scores.shape)} for input {tuple(inputs.shape)}; "
                                 f"expected ({len(inputs)}, 1)")
    return scores.reshape(-1).float()


def score_array(model: Any, inputs: Any, device: str = "cpu", precision: str = "fp32") -> Any:
    """float32 [B, n] numpy -> float32 [B] numpy scores; raises ModelContractError on a wrong output shape."""
    import numpy as np
    import torch

    scores = _forward(model, torch.from_numpy(inputs), device, precision)
    return scores.to("cpu").numpy().astype(np.float32, copy=False)


class _Pending:
    """One scored batch on its way back to the host: on a GPU its scores are copied into pinned host memory behind
    an event, waited for only when the batch is written; on a CPU they are there already."""

    def __init__(self, batch: Any, scores: Any) -> None:
        import torch

        self.batch = batch
        self.done = None
        if scores.device.type == "cpu":
            self.host = scores
        else:
            self.host = torch.empty(scores.shape, dtype=torch.float32, pin_memory=True)
            self.host.copy_(scores, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def scores(self) -> Any:
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


def _upload_ready(inputs: Any, device: str) -> Any:
    """The batch as the device's upload wants it: on a GPU a contiguous pinned copy (a strided or pageable source
    makes the copy wait for the GPU); on a CPU the tensor itself."""
    import torch

    if device == "cpu":
        return inputs
    return torch.empty(inputs.shape, dtype=torch.float32, pin_memory=True).copy_(inputs)


def write_scored(writer: Any, model: Any, batches: Iterable[Any], feature_columns: Sequence[str],
                 model_version: str, device: str = "cpu", precision: str = "fp32") -> int:
    """Scores Arrow batches of features (``customer_id`` and ``feature_columns``) into ``writer`` (a Parquet
    writer of :data:`SCHEMA`), a row group per batch; returns the rows written. Every scoring path's loop.

    A batch is written once the next one is queued: on a GPU the host never waits for the device while it has
    other work (the inputs go up from pinned memory without blocking, the scores come back behind an event), so
    reading and writing on the host overlap the GPU's work. On a CPU the order of work is the same.
    """
    import torch

    version = pa.scalar(model_version, pa.string())
    rows = 0
    pending: _Pending | None = None

    def write(done: _Pending) -> None:
        batch = done.batch
        writer.write_batch(pa.record_batch(
            [pc.cast(batch.column("customer_id"), pa.string()), pa.array(done.scores(), pa.float32()),
             pa.repeat(version, batch.num_rows)], schema=SCHEMA))

    for batch in batches:
        inputs = _upload_ready(torch.from_numpy(batch_inputs(batch, feature_columns)), device)
        queued = _Pending(batch, _forward(model, inputs, device, precision))
        if pending is not None:
            write(pending)
        pending = queued
        rows += batch.num_rows
    if pending is not None:
        write(pending)
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
    files = manifests.partition_files(staging)
    return manifest_of(lambda names: manifests.read_files(files, names), manifests.parquet_rows(files),
                       storage.data_files(staging), f"the staging directory {staging}", ds, features_manifest,
                       columns, job, model_path, model_version)


def manifest_of(read: Callable[[list[str]], pa.Table], rows: int, files: list[str], left: str, ds: str,
                features_manifest: dict[str, Any], columns: list[dict[str, str]], job: dict[str, Any],
                model_path: str, model_version: str) -> dict[str, Any]:
    """The predictions manifest of ``rows`` scored rows that ``read(column names)`` returns, written as ``files``
    (``left``: where they stay when the row count does not match the features manifest)."""
    stats = manifests.table_stats(read, rows, list(PREDICTION_COLUMNS), ["score"])
    if rows != features_manifest["row_count"]:
        raise RuntimeError(f"scored {rows} rows but features/ds={ds} has {features_manifest['row_count']}: "
                           f"not publishing; {left} is left for inspection")
    built = storage.base_manifest("predictions", ds, rows, columns, job)
    built.update(
        model={"path": model_path, "version": model_version, "sha256": file_sha256(model_path)},
        feature_columns=list(features_manifest["feature_columns"]),
        features_manifest={"created_at": features_manifest.get("created_at"),
                           "row_count": features_manifest["row_count"]},
        null_ratio=stats["null_ratio"],
        nan_ratio=stats["nan_ratio"],
        score_stats=stats["feature_stats"]["score"],
        files=files,
    )
    return built
