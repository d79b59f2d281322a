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
from hybridtrain.config import ModelSpec
from hybridtrain.model import ProbabilityModel, Standardize, build_network

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "SMOKE_ROWS", "export_model"]

INPUT_NAME = "INPUT__0"
OUTPUT_NAME = "OUTPUT__0"
SMOKE_ROWS = 16
SMOKE_ATOL = 1e-5


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
) -> dict[str, Any]:
    """Write ``model.pt`` (TorchScript of sigmoid(network)), ``signature.json`` and ``smoke.json``.

    :param state_dict: the full float32 weights of the network built by :func:`build_network`.
    :param mean: the training split's per-feature mean; ``std`` its standard deviation (``standardization``).
    :param smoke_inputs: ``SMOKE_ROWS`` raw feature rows; their outputs are computed by the saved file itself.
    :param details: extra keys for ``signature.json`` (step, model preset, versions).
    :return: what was written: paths and the signature.
    """
    n_features = len(feature_columns)
    network = build_network(n_features, spec)
    network.load_state_dict({key: value.float() for key, value in state_dict.items()})
    scripted = torch.jit.script(ProbabilityModel(Standardize(mean, std), network).eval())

    with staged_dir(export_dir) as staging:
        scripted.save(str(staging / "model.pt"))
        reloaded = torch.jit.load(str(staging / "model.pt"), map_location="cpu")
        inputs = np.ascontiguousarray(smoke_inputs[:SMOKE_ROWS], dtype=np.float32)
        with torch.inference_mode():
            outputs = reloaded(torch.from_numpy(inputs)).numpy()
        signature = {
            **details,
            "format": "torchscript",
            "feature_columns": list(feature_columns),
            "n_features": n_features,
            "inputs": [{"name": INPUT_NAME, "dtype": "float32", "shape": [-1, n_features]}],
            "outputs": [{"name": OUTPUT_NAME, "dtype": "float32", "shape": [-1, 1], "meaning": "probability"}],
            "torch_version": torch.__version__,
        }
        smoke = {
            "input_name": INPUT_NAME,
            "output_name": OUTPUT_NAME,
            "atol": SMOKE_ATOL,
            "inputs": inputs.tolist(),
            "outputs": outputs.tolist(),
        }
        (staging / "signature.json").write_text(json.dumps(signature, indent=2) + "\n")
        (staging / "smoke.json").write_text(json.dumps(smoke, indent=2) + "\n")
    return {
        "model": str(export_dir / "model.pt"),
        "signature": str(export_dir / "signature.json"),
        "smoke": str(export_dir / "smoke.json"),
        "n_features": n_features,
    }
