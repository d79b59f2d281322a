"""Binary classification metrics in numpy (no scikit-learn on the cluster)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LOG_LOSS_EPS", "holdout_figures", "log_loss", "paired_auc_difference", "roc_auc"]

LOG_LOSS_EPS = 1e-7


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve: the probability that a random positive scores above a random negative, ties
    counting one half (the Mann-Whitney U statistic over average ranks).

    :return: None when ``labels`` holds only one class, where the AUC is undefined.
    """
    positive = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    if positive.shape != scores.shape or positive.ndim != 1:
        raise ValueError(f"labels {positive.shape} and scores {scores.shape} must be 1-d of one length")
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    return float((_midranks(scores)[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def paired_auc_difference(labels: np.ndarray, first: np.ndarray, second: np.ndarray) -> tuple[float, float] | None:
    """AUC(``first``) - AUC(``second``), both scores of the same rows, and the standard error of that difference
    (DeLong, DeLong and Clarke-Pearson 1988: the rows' placements under each score, paired).

    :return: None when ``labels`` holds only one class.
    """
    positive = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    placements = []
    for scores in (first, second):
        scores = np.asarray(scores, dtype=np.float64)
        ranks, ranks_pos, ranks_neg = _midranks(scores), _midranks(scores[positive]), _midranks(scores[~positive])
        # a positive's share of negatives scored below it (ties count one half), a negative's share of positives
        # scored above it
        placements.append(((ranks[positive] - ranks_pos) / n_neg, 1.0 - (ranks[~positive] - ranks_neg) / n_pos))
    (pos_first, neg_first), (pos_second, neg_second) = placements
    difference = float(pos_first.mean() - pos_second.mean())
    variance = np.var(pos_first - pos_second, ddof=1) / n_pos if n_pos > 1 else 0.0
    variance += np.var(neg_first - neg_second, ddof=1) / n_neg if n_neg > 1 else 0.0
    return difference, float(np.sqrt(variance))


def _midranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks of ``scores``, tied values sharing their mean rank."""
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    starts_group = np.r_[True, ordered[1:] != ordered[:-1]]
    starts = np.flatnonzero(starts_group)
    ends = np.r_[starts[1:], len(ordered)]
    ranks = np.empty(len(ordered), dtype=np.float64)
    ranks[order] = ((starts + 1 + ends) / 2.0)[np.cumsum(starts_group) - 1]
    return ranks


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy in nats, probabilities clipped to [LOG_LOSS_EPS, 1 - LOG_LOSS_EPS]."""
    truth = np.asarray(labels, dtype=np.float64)
    prob = np.clip(np.asarray(probabilities, dtype=np.float64), LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS)
    if truth.shape != prob.shape or truth.ndim != 1 or not len(truth):
        raise ValueError(
            f"labels {truth.shape} and probabilities {prob.shape} must be 1-d of one non-zero length"
        )
    return float(-np.mean(truth * np.log(prob) + (1.0 - truth) * np.log1p(-prob)))


def holdout_figures(step: int, labels: np.ndarray, logits: np.ndarray) -> dict[str, Any]:
    """The holdout evaluation of the weights at ``step`` from the network's logits: what checkpoints, the step
    metrics and ``metrics.json`` report."""
    scores = np.asarray(logits).astype(np.float64)
    probabilities = 1.0 / (1.0 + np.exp(-scores))
    return {
        "step": step,
        "auc": roc_auc(labels, scores),
        "log_loss": log_loss(labels, probabilities),
        "rows": len(labels),
        "positives": int(labels.sum()),
    }
