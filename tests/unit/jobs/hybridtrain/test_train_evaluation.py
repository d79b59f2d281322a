"""AUC and log loss of the training job, computed in numpy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hybridtrain.evaluation import LOG_LOSS_EPS, holdout_figures, log_loss, paired_auc_difference, roc_auc


def pairwise_auc(labels, scores) -> float:
    """The definition: the share of (positive, negative) pairs ordered correctly, ties counting one half."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize(
    ("labels", "scores", "expected"),
    [
        ([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9], 1.0),
        ([1, 1, 0, 0], [0.1, 0.2, 0.8, 0.9], 0.0),
        ([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5], 0.5),
        ([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], 0.75),
        ([0, 1, 1, 0, 1], [0.2, 0.2, 0.7, 0.7, 0.9], (0.5 + 0 + 1 + 0.5 + 1 + 1) / 6),
        ([0, 1], [-3.0, 2.0], 1.0),
    ],
    ids=["perfect", "inverted", "all-tied", "one-swap", "ties", "logits"],
)
def test_training_auc_table(labels, scores, expected):
    assert roc_auc(np.array(labels), np.array(scores)) == pytest.approx(expected)


@pytest.mark.parametrize("labels", [[0, 0, 0], [1, 1], []], ids=["negatives-only", "positives-only", "empty"])
def test_training_auc_is_undefined_for_one_class(labels):
    assert roc_auc(np.array(labels), np.zeros(len(labels))) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_auc_matches_the_pairwise_definition(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 200)
    scores = np.round(rng.random(200), 1)
    assert roc_auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)


def test_training_auc_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        roc_auc(np.array([0, 1]), np.array([0.1, 0.2, 0.3]))


@pytest.mark.parametrize(
    ("labels", "probabilities", "expected"),
    [
        ([1, 0], [0.5, 0.5], math.log(2)),
        ([1, 0], [0.9, 0.1], -math.log(0.9)),
        (
            [1, 1, 0, 0],
            [0.8, 0.6, 0.3, 0.1],
            -(math.log(0.8) + math.log(0.6) + math.log(0.7) + math.log(0.9)) / 4,
        ),
        ([1, 0], [1.0, 0.0], -math.log(1 - LOG_LOSS_EPS)),
        ([1, 0], [0.0, 1.0], -math.log(LOG_LOSS_EPS)),
    ],
    ids=["coin", "confident-right", "mixed", "certain-right", "certain-wrong-is-clipped"],
)
def test_training_log_loss_table(labels, probabilities, expected):
    assert log_loss(np.array(labels), np.array(probabilities)) == pytest.approx(expected, rel=1e-9)


def test_training_log_loss_rejects_empty_input():
    with pytest.raises(ValueError):
        log_loss(np.array([]), np.array([]))


def test_holdout_figures_score_the_logits_as_probabilities():
    labels = np.array([1, 0, 1, 0, 0], dtype=np.float32)
    logits = np.array([2.0, -1.0, 0.5, 0.7, -3.0], dtype=np.float32)
    figures = holdout_figures(40, labels, logits)
    assert figures == {"step": 40, "auc": roc_auc(labels, logits), "log_loss": pytest.approx(
        log_loss(labels, 1 / (1 + np.exp(-logits.astype(np.float64))))), "rows": 5, "positives": 2}
    assert figures["auc"] == 5 / 6 and isinstance(figures["positives"], int)


def delong_by_pairs(labels, first, second) -> tuple[float, float]:
    """DeLong's paired difference from its definition: each row's placements, pair by pair."""
    def psi(p, n):
        return 1.0 if p > n else 0.5 if p == n else 0.0

    positives = [i for i, y in enumerate(labels) if y]
    negatives = [i for i, y in enumerate(labels) if not y]
    d10 = [np.mean([psi(first[i], first[j]) - psi(second[i], second[j]) for j in negatives]) for i in positives]
    d01 = [np.mean([psi(first[i], first[j]) - psi(second[i], second[j]) for i in positives]) for j in negatives]
    return float(np.mean(d10)), math.sqrt(np.var(d10, ddof=1) / len(d10) + np.var(d01, ddof=1) / len(d01))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_auc_difference_is_delongs_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = (rng.random(40) < 0.4).astype(np.float32)
    first = np.round(rng.normal(size=40) + labels, 1)  # rounded: ties within and across the classes
    second = np.round(first + rng.normal(0, 0.3, size=40), 1)
    difference, se = paired_auc_difference(labels, first, second)
    assert difference == pytest.approx(pairwise_auc(labels, first) - pairwise_auc(labels, second), abs=1e-12)
    assert (difference, se) == pytest.approx(delong_by_pairs(labels, first, second), abs=1e-12)
    assert se > 0


def test_paired_auc_difference_of_one_score_is_zero_and_needs_both_classes():
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    assert paired_auc_difference([0, 0, 1, 1], scores, scores) == (0.0, 0.0)
    assert paired_auc_difference([1, 1, 1, 1], scores, scores[::-1]) is None
