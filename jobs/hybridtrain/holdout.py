"""Scoring rows with the training engine itself: the holdout evaluation (at each checkpoint and the end) and the
smoke rows the export is checked against. Every rank scores: a ZeRO-3 forward is collective."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hybridtrain.evaluation import holdout_figures
from hybridtrain.heartbeat import Heartbeat

__all__ = ["EVAL_CHUNK_ROWS", "EngineScorer"]

EVAL_CHUNK_ROWS = 65_536


class EngineScorer:
    """The engine's forward in eval mode (dropout off), back in train mode afterwards.

    :param dtype: what the engine takes its inputs in (``engine.input_dtype``).
    """

    def __init__(self, engine: Any, device: torch.device, dtype: torch.dtype, heartbeat: Heartbeat) -> None:
        self.engine = engine
        self.device = device
        self.dtype = dtype
        self.heartbeat = heartbeat

    def evaluate(self, step: int, features: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
        """Holdout AUC and log loss of the weights at ``step`` (see :func:`holdout_figures`)."""
        self.heartbeat.beat(phase="evaluating")
        self.engine.eval()
        logits = []
        with torch.no_grad():
            for start in range(0, len(labels), EVAL_CHUNK_ROWS):
                chunk = torch.from_numpy(features[start : start + EVAL_CHUNK_ROWS])
                output = self.engine(chunk.to(self.device, dtype=self.dtype)).float().squeeze(1)
                logits.append(output.cpu().numpy())
                self.heartbeat.beat()  # a long holdout is progress too, for the stall watch
        self.engine.train()
        return holdout_figures(step, labels, np.concatenate(logits))

    def probabilities(self, standardized: np.ndarray) -> np.ndarray:
        """The engine's probabilities for standardised rows."""
        self.engine.eval()
        with torch.no_grad():
            inputs = torch.from_numpy(np.ascontiguousarray(standardized, dtype=np.float32))
            logits = self.engine(inputs.to(self.device, dtype=self.dtype)).float()
        self.engine.train()
        return torch.sigmoid(logits).cpu().numpy()
