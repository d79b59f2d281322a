"""Latency figures from measured request times: percentiles, throughput, the SLO verdict of a deploy gate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


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
    """What a short load measured: per-request latency percentiles, throughput, and requests that failed."""

    requests: int
    concurrency: int
    p50_ms: float | None
    p99_ms: float | None
    throughput_rps: float
    failed: int

    def to_dict(self) -> dict:
        return asdict(self)

    def breach(self, slo_p99_ms: float) -> str | None:
        """Why the figures fail the gate, or None when they pass."""
        if self.failed:
            return f"{self.failed} of {self.requests} requests failed"
        if self.p99_ms is None:
            return "no request was measured"
        if self.p99_ms > slo_p99_ms:
            return f"p99 {self.p99_ms:.2f} ms is over the SLO of {slo_p99_ms:g} ms"
        return None


def summarize(latencies_s: Sequence[float], wall_s: float, concurrency: int,
              failed: int = 0) -> LatencySummary:
    """Figures of a load: ``latencies_s`` of the requests that succeeded, ``wall_s`` of the whole load."""
    if wall_s <= 0:
        raise ValueError(f"wall_s={wall_s}: the load must have taken some time")
    ok = len(latencies_s)
    return LatencySummary(
        requests=ok + failed,
        concurrency=concurrency,
        p50_ms=round(percentile(latencies_s, 50) * 1000, 3) if ok else None,
        p99_ms=round(percentile(latencies_s, 99) * 1000, 3) if ok else None,
        throughput_rps=round(ok / wall_s, 1),
        failed=failed,
    )
