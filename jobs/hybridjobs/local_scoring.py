"""Batch scoring without Spark: a TorchScript model over a features partition, read and written with pyarrow one
batch at a time, on the GPU the job was given (the CPUs when it has none).

The job of the Slurm GPU route (``jobs/score_batch_local.py``). It publishes exactly what the Spark scorer
(``hybridjobs.scoring``) publishes: the same columns, an atomic partition, the manifest of
``hybridjobs.predictions`` with the row count checked against the features manifest; its job section adds the
device. Needs torch, numpy and pyarrow, never pyspark: the cluster's job environment has no Spark.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from hybridjobs import manifests, predictions, storage
from hybridjobs.layout import SIGNATURE_FILE
from hybridjobs.predictions import COLUMNS, DEFAULT_BATCH_SIZE, SCHEMA, ModelContractError

__all__ = ["COLUMNS", "DEFAULT_BATCH_SIZE", "DEVICES", "PRECISION_CHOICES", "ModelContractError", "probe",
           "resolve_device", "resolve_precision", "run"]
DEVICES = ("auto", "cpu", "cuda")
# auto: bf16 on a GPU when the model's export check allowed it, else fp32; bf16 asks for it on any device (and
# still needs the check's approval); fp32 always.
PRECISION_CHOICES = ("auto", "fp32", "bf16")


def resolve_device(requested: str | None = None) -> str:
    """``cuda`` when torch sees a GPU, else ``cpu`` (``None`` or ``auto``); ``cuda`` without a GPU is an error."""
    import torch

    if requested not in (None, *DEVICES):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device cuda asked for, but torch {torch.__version__} sees no GPU "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, built for CUDA "
                         f"{torch.version.cuda})")
    return requested


def model_precision(model_path: str) -> dict[str, Any] | None:
    """The export's bf16 check (``signature.json`` "precision"), or None for a model exported without one."""
    try:
        signature = json.loads(Path(model_path).with_name(SIGNATURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    precision = signature.get("precision") if isinstance(signature, dict) else None
    return precision if isinstance(precision, dict) else None


def resolve_precision(requested: str, device: str, record: dict[str, Any] | None) -> str:
    """``fp32`` or ``bf16`` for a run on ``device``, from the request and the model's export check ``record``.

    :raises ModelContractError: bf16 asked for where the model's check did not allow it.
    """
    if requested not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {requested!r}")
    allowed = (record or {}).get("scoring") == "bf16"
    if requested == "bf16" and not allowed:
        why = ((record or {}).get("check") or {}).get("reason") or "the model was exported without a bf16 check"
        raise ModelContractError(f"precision bf16 asked for, but the model's export check did not allow it ({why}): "
                                 "score with --precision fp32 (or auto), or re-export the model")
    if requested == "auto":
        return "bf16" if allowed and device == "cuda" else "fp32"
    return requested


def allotted_cpus() -> int:
    """The CPUs this process may run on: what Slurm gave the job (its CPU binding), else the machine's."""
    return len(os.sched_getaffinity(0))


def _device_job(device: str, batch_size: int, precision: str, record: dict[str, Any] | None) -> dict[str, Any]:
    """The job section's keys that say where and in what precision the scoring ran."""
    import torch

    return {
        "device": device,
        "precision": precision,
        "precision_check": (record or {}).get("check"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
    }


def _prepare(model_version: str, batch_size: int, device: str | None) -> str:
    """Checks the arguments; returns the device and sets torch's threads to the process's CPUs."""
    import torch

    predictions.check_version(model_version)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = resolve_device(device)
    torch.set_num_threads(allotted_cpus())
    return device


def prefetched(items: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """``items`` produced by a thread up to ``depth`` ahead (pyarrow decodes without the GIL), so reading the next
    batch overlaps scoring and writing this one; the producer's exception is raised here, in order."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                slots.put((item, None))
        except BaseException as err:  # handed to the consumer
            slots.put((done, err))
            return
        slots.put((done, None))

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, err = slots.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(0.01)


def _score_file(model: Any, source: Path, out: Path, feature_columns: list[str], model_version: str,
                batch_size: int, device: str, precision: str) -> int:
    """Scores one features file into one predictions file, a row group per batch; returns the rows written."""
    with pq.ParquetFile(source) as reader, pq.ParquetWriter(out, SCHEMA) as writer:
        batches = reader.iter_batches(batch_size=batch_size, columns=["customer_id", *feature_columns])
        return predictions.write_scored(writer, model, prefetched(batches), feature_columns, model_version, device,
                                        precision)


def run(root: str, ds: str, model_path: str, model_version: str, batch_size: int = DEFAULT_BATCH_SIZE,
        device: str | None = None, precision: str = "auto") -> dict[str, Any]:
    """Scores ``features/ds=<ds>`` and publishes ``predictions/ds=<ds>``, replacing an earlier run of the ds;
    returns the predictions manifest.

    :param device: ``cpu``, ``cuda`` or ``auto``/None (the GPU when torch sees one). Torch runs on as many threads
        as the process has CPUs (those Slurm gave the job).
    :param precision: see :data:`PRECISION_CHOICES` and :func:`resolve_precision`.
    :raises storage.PartitionNotPublishedError: the features partition is not published.
    :raises storage.ManifestError: its manifest lacks ``feature_columns`` or ``row_count``.
    :raises ModelContractError: the model does not take the manifest's feature columns (before any row is read),
        or bf16 was asked for and its export check did not allow it.
    """
    device = _prepare(model_version, batch_size, device)
    record = model_precision(model_path)
    precision = resolve_precision(precision, device, record)
    started = time.monotonic()
    storage.parse_ds(ds)  # checked once, before any path is built from it
    partitions = storage.Partitions.under(root)
    features_dir = partitions.dir("features", ds)
    features_manifest = storage.read_features_manifest(features_dir)
    feature_columns = list(features_manifest["feature_columns"])
    predictions.check_model(model_path, len(feature_columns), device)
    model = predictions.load_model(model_path, device)

    target = partitions.dir("predictions", ds)
    staging = storage.new_staging_dir(target)
    staging.mkdir()
    sources = manifests.partition_files(features_dir)
    if not sources:  # an empty partition still carries the schema, as Spark writes one
        pq.write_table(SCHEMA.empty_table(), staging / "part-00000.parquet")
    rows = sum(_score_file(model, source, staging / f"part-{index:05d}.parquet", feature_columns, model_version,
                           batch_size, device, precision)
               for index, source in enumerate(sources))
    seconds = round(time.monotonic() - started, 3)
    job = {"name": "score_batch_local", **_device_job(device, batch_size, precision, record), "seconds": seconds,
           "rows_per_s": round(rows / seconds, 1) if seconds else None}
    manifest = predictions.manifest(staging, ds, features_manifest, COLUMNS, job, model_path, model_version)
    return storage.publish(staging, target, manifest)


def model_width(model_path: str) -> int:
    """The model's number of input features, from the ``signature.json`` its export wrote beside it."""
    signature = Path(model_path).with_name(SIGNATURE_FILE)
    try:
        return int(json.loads(signature.read_text())["n_features"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelContractError(f"cannot read the model's input width (n_features) from {signature}: {err}; "
                                 "the probe needs a model exported by the training job") from err


def probe(model_path: str, model_version: str, rows: int, batch_size: int = DEFAULT_BATCH_SIZE,
          device: str | None = None, precision: str = "auto") -> dict[str, Any]:
    """Scores ``rows`` synthetic rows with the model on ``device`` and publishes nothing: proves the scoring side
    (job environment, device, model) works and measures its rate when there is no partition to score.

    :raises ModelContractError: the model has no readable signature or does not take its own width.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    device = _prepare(model_version, batch_size, device)
    record = model_precision(model_path)
    precision = resolve_precision(precision, device, record)
    n_features = model_width(model_path)
    predictions.check_model(model_path, n_features, device)
    model = predictions.load_model(model_path, device)
    generator = np.random.default_rng(0)
    started = time.monotonic()
    scored = 0
    for offset in range(0, rows, batch_size):
        inputs = generator.standard_normal((min(batch_size, rows - offset), n_features), dtype=np.float32)
        scored += len(predictions.score_array(model, inputs, device, precision))
    seconds = round(time.monotonic() - started, 3)
    return {"name": "score_batch_local probe", "rows": scored, "n_features": n_features,
            "model": {"path": model_path, "version": model_version},
            **_device_job(device, batch_size, precision, record),
            "seconds": seconds, "rows_per_s": round(scored / seconds, 1) if seconds else None}
