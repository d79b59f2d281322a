"""Latency figures from measured request times: percentiles, throughput, the SLO verdict of a deploy gate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hybridflow.utils.bounds import quantile_lower_bound, quantile_upper_bound


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..100) of unsorted values: an observed value, no interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}: a percentile is between 0 and 100")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LatencySummary:
    """What a short load measured: per-request latency percentiles over the requests after the warm-up, the p99's
    distribution-free bounds at ``confidence`` (None where the samples are too few for one), throughput, and
    requests that failed."""

    requests: int
    concurrency: int
    p50_ms: float | None
    p99_ms: float | None
    throughput_rps: float
    failed: int
    warmup: int = 0
    measured: int = 0
    confidence: float = 0.95
    p99_low_ms: float | None = None
    p99_high_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        """``p99 12.30 ms of 380 requests after 20 warm-up; 95% bounds [9.80, 20.10] ms``."""
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        return (f"p99 {ms(self.p99_ms)} ms of {self.measured} requests after {self.warmup} warm-up; "
                f"{self.confidence:.0%} bounds [{ms(self.p99_low_ms)}, {ms(self.p99_high_ms)}] ms")


def summarize(latencies_s: Sequence[float], wall_s: float, concurrency: int, failed: int = 0, warmup: int = 0,
              confidence: float = 0.95) -> LatencySummary:
    """Figures of a load: ``latencies_s`` of the requests that succeeded, in the order they ended (the first
    ``warmup`` are left out of the percentiles: connections, caches, the first batches), ``wall_s`` of the whole
    load."""
    if wall_s <= 0:
        raise ValueError(f"wall_s={wall_s}: the load must have taken some time")
    ok = len(latencies_s)
    measured = list(latencies_s[warmup:]) if ok > warmup else list(latencies_s)
    low = quantile_lower_bound(measured, 99, confidence) if measured else None
    high = quantile_upper_bound(measured, 99, confidence) if measured else None
    return LatencySummary(
        requests=ok + failed,
        concurrency=concurrency,
        p50_ms=round(percentile(measured, 50) * 1000, 3) if ok else None,
        p99_ms=round(percentile(measured, 99) * 1000, 3) if ok else None,
        throughput_rps=round(ok / wall_s, 1),
        failed=failed,
        warmup=ok - len(measured),
        measured=len(measured),
        confidence=confidence,
        p99_low_ms=None if low is None else round(low * 1000, 3),
        p99_high_ms=None if high is None else round(high * 1000, 3),
    )
