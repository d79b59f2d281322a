"""The propensity network (an MLP of configurable widths, one logit out) and the served model around it.

Training feeds standardised features to the DeepSpeed engine (standardised once, in float32, so bf16 or fp16
engines do not lose precision on raw values); the exported model takes raw features and standardises them with
the training split's statistics itself.
"""

from __future__ import annotations

import numpy as np
import torch
from hybridtrain.config import ModelSpec
from torch import nn

__all__ = ["ProbabilityModel", "Standardize", "build_network", "count_parameters"]


class Standardize(nn.Module):
    """``(x - mean) / std`` with fixed statistics kept as float32 buffers."""

    def __init__(self, mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("inv_std", torch.as_tensor(1.0 / std, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) * self.inv_std


class ProbabilityModel(nn.Module):
    """The served model: raw float32 ``[B, n_features]`` -> probabilities float32 ``[B, 1]``."""

    def __init__(self, standardize: Standardize, network: nn.Module) -> None:
        super().__init__()
        self.standardize = standardize
        self.network = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.network(self.standardize(x)))


def build_network(n_features: int, spec: ModelSpec) -> nn.Sequential:
    """(Linear, ReLU[, Dropout]) per hidden width, then Linear to one logit."""
    layers: list[nn.Module] = []
    width = n_features
    for hidden in spec.hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if spec.dropout > 0:
            layers.append(nn.Dropout(spec.dropout))
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def count_parameters(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())
