"""Exports the trained network as TorchScript for batch scoring and Triton, with a signature and a smoke set.

``export/`` is built in a hidden staging directory beside it and swapped into place (hybridjobs.atomic), so a
reader sees the previous export or the new one, never a mix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hybridjobs.atomic import staged_dir
from hybridjobs.layout import MODEL_FILE, SIGNATURE_FILE, SMOKE_FILE
from hybridtrain.config import ModelSpec
from hybridtrain.errors import TrainingJobError
from hybridtrain.model import ProbabilityModel, Standardize, build_network

__all__ = ["AUC_LOSS_Z", "BF16_LIMITS", "ENGINE_TOLERANCE", "INPUT_NAME", "OUTPUT_NAME", "PRECISION_SAMPLE_ROWS",
           "SMOKE_ROWS", "difference_from_engine", "export_model", "precision_check"]

INPUT_NAME = "INPUT__0"
OUTPUT_NAME = "OUTPUT__0"
SMOKE_ROWS = 16
SMOKE_ATOL = 1e-5
# Scoring may use bf16 autocast only when, on the smoke set and a holdout sample, no probability moves by more
# than this and the AUC loses no more than this (issue 21), beyond the noise of the rows compared (issue 37).
BF16_LIMITS = {"max_abs_diff": 0.01, "auc_diff": 0.001}
# One-sided 95%: bf16 is refused for its AUC only when the loss minus this many standard errors exceeds the limit.
AUC_LOSS_Z = 1.645
PRECISION_SAMPLE_ROWS = 20_000
# How far the export's smoke outputs may be from the trained engine's, by whether the engine computes in float32:
# the engine computes in bf16/fp16 when the DeepSpeed config says so; the export always in float32.
ENGINE_TOLERANCE = {True: 1e-5, False: 2e-2}


def export_model(
    state_dict: Mapping[str, torch.Tensor],
    *,
    spec: ModelSpec,
    mean: np.ndarray,
    std: np.ndarray,
    feature_columns: tuple[str, ...],
    smoke_inputs: np.ndarray,
    export_dir: Path,
    details: Mapping[str, Any],
    precision_sample: tuple[np.ndarray, np.ndarray] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Write ``model.pt`` (TorchScript of sigmoid(network)), ``signature.json`` and ``smoke.json``.

    :param state_dict: the full float32 weights of the network built by :func:`build_network`.
    :param mean: the training split's per-feature mean; ``std`` its standard deviation (``standardization``).
    :param smoke_inputs: ``SMOKE_ROWS`` raw feature rows; their outputs are computed by the saved file itself.
    :param details: extra keys for ``signature.json`` (step, model preset, versions).
    :param precision_sample: raw holdout rows and their labels for :func:`precision_check` (with the smoke
        rows); None checks the smoke rows alone (no AUC, so scoring stays in float32).
    :param device: where the check runs (the training device: bf16 is judged where it will be used).
    :return: what was written: paths and the signature.
    """
    n_features = len(feature_columns)
    network = build_network(n_features, spec)
    network.load_state_dict({key: value.float() for key, value in state_dict.items()})
    scripted = torch.jit.script(ProbabilityModel(Standardize(mean, std), network).eval())

    with staged_dir(export_dir) as staging:
        scripted.save(str(staging / MODEL_FILE))
        reloaded = torch.jit.load(str(staging / MODEL_FILE), map_location="cpu")
        inputs = np.ascontiguousarray(smoke_inputs[:SMOKE_ROWS], dtype=np.float32)
        with torch.inference_mode():
            outputs = reloaded(torch.from_numpy(inputs)).numpy()
        sample_x, sample_y = precision_sample if precision_sample is not None else (inputs[:0], np.zeros(0))
        precision = precision_check(
            torch.jit.load(str(staging / MODEL_FILE), map_location=device),
            np.concatenate([inputs, np.asarray(sample_x, dtype=np.float32)]),
            np.asarray(sample_y),
            device,
        )
        signature = {
            **details,
            "format": "torchscript",
            "feature_columns": list(feature_columns),
            "n_features": n_features,
            "inputs": [{"name": INPUT_NAME, "dtype": "float32", "shape": [-1, n_features]}],
            "outputs": [{"name": OUTPUT_NAME, "dtype": "float32", "shape": [-1, 1], "meaning": "probability"}],
            "torch_version": torch.__version__,
            "precision": precision,
        }
        smoke = {
            "input_name": INPUT_NAME,
            "output_name": OUTPUT_NAME,
            "atol": SMOKE_ATOL,
            "inputs": inputs.tolist(),
            "outputs": outputs.tolist(),
        }
        (staging / SIGNATURE_FILE).write_text(json.dumps(signature, indent=2) + "\n")
        (staging / SMOKE_FILE).write_text(json.dumps(smoke, indent=2) + "\n")
    return {
        "model": str(export_dir / MODEL_FILE),
        "signature": str(export_dir / SIGNATURE_FILE),
        "smoke": str(export_dir / SMOKE_FILE),
        "n_features": n_features,
        "precision": precision,
    }


def difference_from_engine(export_dir: Path, engine_outputs: np.ndarray, *, engine_float32: bool) -> float:
    """How far the export's smoke outputs are from the engine's probabilities on the same rows.

    :raises TrainingJobError: beyond :data:`ENGINE_TOLERANCE`: the export is not the model that was trained.
    """
    smoke = json.loads((export_dir / SMOKE_FILE).read_text())
    difference = float(np.max(np.abs(np.array(smoke["outputs"]) - engine_outputs)))
    tolerance = ENGINE_TOLERANCE[engine_float32]
    if not difference <= tolerance:
        raise TrainingJobError(
            f"the exported model differs from the trained engine by {difference:.2e} (> {tolerance}) on "
            f"the smoke rows: {export_dir} is not trustworthy"
        )
    return difference


def precision_check(model: Any, inputs: np.ndarray, labels: np.ndarray, device: str) -> dict[str, Any]:
    """Whether scoring may run under bf16 autocast: the model's float32 and bf16 probabilities on ``inputs``
    (the smoke rows, then holdout rows whose ``labels`` follow in order) differ by at most
    ``BF16_LIMITS['max_abs_diff']``, and bf16 loses no more than ``BF16_LIMITS['auc_diff']`` of the holdout AUC
    on signal: both AUCs come from the same rows, so the loss is judged with its paired standard error
    (``paired_auc_difference``), and refused only when ``loss - AUC_LOSS_Z * se`` is above the limit. On a small
    holdout an AUC difference of the limit's size is noise (0.00101 on 1,200 rows of a dry run).

    :return: ``{"scoring": "bf16" | "fp32", "check": {figures, limits, rows, device, reason}}``; without labels
        of both classes the AUC cannot be compared, and scoring stays in float32.
    """
    from hybridtrain.evaluation import paired_auc_difference, roc_auc

    tensor = torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.float32)).to(device)
    with torch.inference_mode():
        fp32 = model(tensor).float().reshape(-1).cpu().numpy()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            bf16 = model(tensor).float().reshape(-1).cpu().numpy()
    max_abs = float(np.max(np.abs(bf16 - fp32))) if len(fp32) else None
    labelled = len(labels)
    auc_fp32 = roc_auc(labels, fp32[-labelled:]) if labelled else None
    auc_bf16 = roc_auc(labels, bf16[-labelled:]) if labelled else None
    paired = paired_auc_difference(labels, fp32[-labelled:], bf16[-labelled:]) if labelled else None
    loss, se = paired if paired is not None else (None, None)
    bound = None if paired is None else loss - AUC_LOSS_Z * se
    if max_abs is None or paired is None:
        safe, reason = False, "no holdout labels of both classes: the AUC could not be compared"
    else:
        safe = max_abs <= BF16_LIMITS["max_abs_diff"] and bound <= BF16_LIMITS["auc_diff"]
        reason = (f"max |p_bf16 - p_fp32| {max_abs:.2e} (limit {BF16_LIMITS['max_abs_diff']}), AUC loss "
                  f"{loss:.2e} +- {se:.2e} on {labelled} rows, at least {bound:.2e} (limit {BF16_LIMITS['auc_diff']})")
    return {
        "scoring": "bf16" if safe else "fp32",
        "check": {
            "max_abs_diff": max_abs,
            "auc_fp32": auc_fp32,
            "auc_bf16": auc_bf16,
            "auc_diff": None if paired is None else abs(loss),
            "auc_loss": loss,
            "auc_loss_se": se,
            "auc_loss_bound": bound,
            "limits": dict(BF16_LIMITS),
            "rows": len(fp32),
            "labelled_rows": labelled,
            "device": str(device),
            "reason": reason,
        },
    }
