"""Champion/challenger evaluation: both exported TorchScript models scored on the same holdout rows.

Usage: python jobs/evaluate.py --features-root ROOT --ds 2026-01-01,2026-01-02 --challenger run/export/model.pt
       [--champion models/propensity/v3/model.pt] [--holdout-fraction 0.2] --out eval.json

The holdout is the training job's own split (a stable hash of customer_id), so a customer the challenger trained
on never counts; the champion is scored on exactly the same rows, which makes the two AUCs comparable. Runs with
torch, numpy and pyarrow, never Airflow: on the GPU Slurm gave the job when there is one (float32, chunks of
65,536 rows), else on its CPUs; the result names the device. Each model file is loaded and scored once (a champion
that is the challenger too is the same scores), the holdout rows go to the GPU once for both, from page-locked
memory, and the result's ``phases_s`` says where the time went: read (the partitions), hash (the holdout split),
load (the models), score, metrics.
Exit codes: 0 written, 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hybridtrain.checkpoints import write_json_atomic  # noqa: E402
from hybridtrain.errors import FeatureDataError  # noqa: E402
from hybridtrain.evaluation import log_loss, roc_auc  # noqa: E402
from hybridtrain.features import holdout_mask, read_feature_partitions  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features-root", required=True)
    parser.add_argument("--ds", required=True, help="comma-separated feature partitions, YYYY-MM-DD")
    parser.add_argument("--challenger", required=True, help="the new model's TorchScript file")
    parser.add_argument("--champion", default=None, help="the model of record's TorchScript file, if any")
    parser.add_argument("--holdout-fraction", type=float, default=0.2)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    return parser.parse_args(argv)


CHUNK_ROWS = 65_536


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def on_device(features: np.ndarray, where: str) -> torch.Tensor:
    """The rows on the scoring device, copied once for every model (from page-locked memory to a GPU)."""
    rows = torch.from_numpy(features)
    if where == "cuda":
        rows = rows.pin_memory().to(where, non_blocking=True)
    return rows


def score(model: torch.jit.ScriptModule, rows: torch.Tensor) -> np.ndarray:
    """The model's probabilities in float32 (an AUC compared to 0.002 needs no bf16 rounding), chunk by chunk."""
    with torch.inference_mode():
        chunks = [model(rows[start:start + CHUNK_ROWS]).reshape(-1) for start in range(0, len(rows), CHUNK_ROWS)]
        return torch.cat(chunks).cpu().numpy().astype(np.float64)


def metrics(labels: np.ndarray, probabilities: np.ndarray) -> dict:
    return {"auc": roc_auc(labels, probabilities), "log_loss": log_loss(labels, probabilities)}


@contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    phases[phase] = round(time.perf_counter() - started, 3)


def evaluate(features_root: str, ds: tuple[str, ...], challenger: str, champion: str | None,
             holdout_fraction: float) -> dict:
    phases: dict[str, float] = {}
    where = device()
    with timed(phases, "read"):
        data = read_feature_partitions(features_root, ds)
    with timed(phases, "hash"):
        mask = holdout_mask(data.customer_ids, holdout_fraction)
        if not mask.any():
            raise FeatureDataError(f"no holdout rows in {list(ds)} at holdout_fraction {holdout_fraction}")
        features, labels = np.ascontiguousarray(data.features[mask]), data.labels[mask]
    paths = list(dict.fromkeys(path for path in (challenger, champion) if path))
    with timed(phases, "load"):
        models = {path: torch.jit.load(path, map_location=where).eval() for path in paths}
    with timed(phases, "score"):
        rows = on_device(features, where)
        probabilities = {path: score(model, rows) for path, model in models.items()}
    with timed(phases, "metrics"):
        figures = {path: metrics(labels, scores) for path, scores in probabilities.items()}
    return {
        "ds": list(ds),
        "holdout_rows": int(mask.sum()),
        "holdout_positive_rate": round(float(labels.mean()), 6),
        "device": where,
        "challenger": {"model": challenger, **figures[challenger]},
        "champion": {"model": champion, **figures[champion]} if champion else None,
        "phases_s": phases,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    ds = tuple(d for d in args.ds.split(",") if d)
    if not ds:
        print("EVALUATE FAILED: --ds lists no partition", file=sys.stderr)
        return 2
    if not 0 < args.holdout_fraction < 1:
        print(f"EVALUATE FAILED: --holdout-fraction {args.holdout_fraction} must be between 0 and 1", file=sys.stderr)
        return 2
    for flag, path in (("--challenger", args.challenger), ("--champion", args.champion)):
        if path and not os.path.isfile(path):
            print(f"EVALUATE FAILED: {flag} {path} does not exist", file=sys.stderr)
            return 2
    torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    started = time.monotonic()
    try:
        result = evaluate(args.features_root, ds, args.challenger, args.champion, args.holdout_fraction)
    except FeatureDataError as error:
        print(f"EVALUATE FAILED: {error}", file=sys.stderr)
        return 2
    result["seconds"] = round(time.monotonic() - started, 3)
    write_json_atomic(Path(args.out), result)
    print(f"EVALUATE {json.dumps(result, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
