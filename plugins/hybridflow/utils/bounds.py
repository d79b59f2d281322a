"""Distribution-free confidence bounds for the judgements made from measurements (release steps, deploy gates).

A percentile of ``n`` latencies is bounded by order statistics whose ranks come from the binomial distribution
(the count of samples under the true percentile is Binomial(n, q)): no assumption about the latencies' shape, and a
bound that needs no more samples than the confidence asks for. A count of errors is judged with the one-sided
exact binomial test. Pure, standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache


@lru_cache(maxsize=256)
def _binomial_cdf_table(n: int, p: float) -> tuple[float, ...]:
    """``P(X <= k)`` for k = 0..n, X ~ Binomial(n, p), summed in log space (n reaches thousands)."""
    if p <= 0.0 or p >= 1.0:
        return tuple(1.0 if (p <= 0.0 or k == n) else 0.0 for k in range(n + 1))
    log_p, log_q = math.log(p), math.log1p(-p)
    total, table = 0.0, []
    for k in range(n + 1):
        log_pmf = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q
        total += math.exp(log_pmf)
        table.append(min(total, 1.0))
    return tuple(table)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(X <= k)`` for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return _binomial_cdf_table(n, round(p, 12))[k]


def _check(q: float, confidence: float) -> None:
    if not 0 < q < 100:
        raise ValueError(f"q={q}: a percentile strictly between 0 and 100")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence={confidence}: expected a value in [0.5, 1)")


def lower_rank(n: int, q: float, confidence: float) -> int | None:
    """The highest rank ``l`` (1-based, ascending) whose order statistic is below the ``q``-th percentile with
    probability ``confidence``: at least ``l`` of ``n`` samples fall under it, ``P(Bin(n, q) >= l) >= confidence``.
    None when even the smallest sample is no such bound (too few samples)."""
    _check(q, confidence)
    best = None
    for rank in range(1, n + 1):
        if 1.0 - binomial_cdf(rank - 1, n, q / 100) >= confidence:
            best = rank
        else:
            break
    return best


def upper_rank(n: int, q: float, confidence: float) -> int | None:
    """The lowest rank ``u`` whose order statistic is above the ``q``-th percentile with probability
    ``confidence``: ``P(Bin(n, q) <= u - 1) >= confidence``. None when even the largest sample is no such bound:
    the percentile needs more samples (:func:`samples_for_upper_bound`)."""
    _check(q, confidence)
    for rank in range(max(1, math.floor(n * q / 100)), n + 1):
        if binomial_cdf(rank - 1, n, q / 100) >= confidence:
            return rank
    return None


def samples_for_upper_bound(q: float, confidence: float) -> int:
    """The fewest samples for which the ``q``-th percentile has an upper bound at ``confidence`` (the largest
    sample is one when ``1 - (q/100)^n >= confidence``): 299 for p99 at 95%, 5 for p50."""
    _check(q, confidence)
    return math.ceil(math.log(1 - confidence) / math.log(q / 100) - 1e-9)


def quantile_lower_bound(values: Sequence[float], q: float, confidence: float) -> float | None:
    rank = lower_rank(len(values), q, confidence)
    return None if rank is None else sorted(values)[rank - 1]


def quantile_upper_bound(values: Sequence[float], q: float, confidence: float) -> float | None:
    rank = upper_rank(len(values), q, confidence)
    return None if rank is None else sorted(values)[rank - 1]


def most_explained(n: int, rate: float, confidence: float) -> int:
    """The most events of ``n`` trials that a true ``rate`` still explains at ``confidence``: the smallest ``c``
    with ``P(Bin(n, rate) <= c) >= confidence``. More than that is evidence the rate is higher (exact one-sided
    binomial test)."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence={confidence}: expected a value in [0.5, 1)")
    for count in range(n + 1):
        if binomial_cdf(count, n, rate) >= confidence:
            return count
    return n
