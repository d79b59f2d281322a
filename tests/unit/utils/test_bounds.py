"""Distribution-free bounds, by tables against hand-computed binomial figures, and their coverage checked on
samples of a known distribution."""

from __future__ import annotations

import math
import random

import pytest
from hybridflow.utils.bounds import (
    binomial_cdf,
    lower_rank,
    most_explained,
    quantile_lower_bound,
    quantile_upper_bound,
    samples_for_upper_bound,
    upper_rank,
)


@pytest.mark.parametrize(("k", "n", "p", "expected"), [
    (0, 10, 0.5, 1 / 1024), (5, 10, 0.5, 638 / 1024), (9, 10, 0.5, 1023 / 1024), (10, 10, 0.5, 1.0),
    (-1, 10, 0.5, 0.0), (82, 83, 0.99, 1 - 0.99**83), (0, 100, 0.01, 0.99**100),
])
def test_binomial_cdf(k, n, p, expected):
    assert binomial_cdf(k, n, p) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("n", "q", "confidence", "lower", "upper"), [
    (83, 99, 0.975, 80, None),  # the 4th largest of 83 bounds p99 below; nothing bounds it above
    (100, 99, 0.975, 97, None),
    (400, 99, 0.975, 392, 400),
    (5000, 99, 0.975, 4936, 4964),
    (83, 50, 0.975, 33, 51),
    (5, 50, 0.975, None, None),  # 1 - 0.5^5 < 0.975: five samples bound no median
    (6, 50, 0.975, 1, 6),
])
def test_order_statistic_ranks(n, q, confidence, lower, upper):
    assert lower_rank(n, q, confidence) == lower
    assert upper_rank(n, q, confidence) == upper


@pytest.mark.parametrize(("q", "confidence", "expected"), [(99, 0.95, 299), (99, 0.975, 368), (50, 0.975, 6),
                                                             (90, 0.95, 29)])
def test_samples_for_an_upper_bound(q, confidence, expected):
    assert samples_for_upper_bound(q, confidence) == expected
    assert upper_rank(expected, q, confidence) == expected and upper_rank(expected - 1, q, confidence) is None


@pytest.mark.parametrize(("n", "rate", "confidence", "expected"), [
    (100, 0.01, 0.95, 3), (1000, 0.01, 0.95, 15), (50, 0.01, 0.95, 2), (10, 0.5, 0.95, 8), (0, 0.01, 0.95, 0),
])
def test_the_most_errors_a_rate_explains(n, rate, confidence, expected):
    assert most_explained(n, rate, confidence) == expected
    assert binomial_cdf(expected, n, rate) >= confidence > binomial_cdf(expected - 1, n, rate)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: lower_rank(10, 100, 0.95), "q=100"), (lambda: upper_rank(10, 0, 0.95), "q=0"),
    (lambda: lower_rank(10, 50, 1.0), "confidence=1.0"), (lambda: most_explained(10, 0.1, 0.2), "confidence=0.2"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_bounds_cover_the_true_percentile_as_often_as_they_claim():
    """400 exponential samples, 1000 times: p99's 97.5% bounds miss the true p99 at most about 2.5% of the time."""
    draw = random.Random(7)
    true_p99 = -math.log(0.01)
    below = above = 0
    for _ in range(1000):
        sample = [draw.expovariate(1.0) for _ in range(400)]
        below += quantile_lower_bound(sample, 99, 0.975) > true_p99
        above += quantile_upper_bound(sample, 99, 0.975) < true_p99
    assert below <= 40 and above <= 40, (below, above)  # 25 expected at most; 40 leaves room for chance
