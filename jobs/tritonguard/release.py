"""A model's release state in the guard, and what each version answered while it holds.

``stable``: one version serves. ``shadow``: the candidate also gets a copy of each request that names no version;
its answer is compared, never returned. ``canary``: the candidate answers ``share`` percent of the requests that
name no version. A request naming a version always gets that version. The split is drawn per request, so it needs
no state beyond the release itself and holds on any number of guard processes.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

STABLE, SHADOW, CANARY = "stable", "shadow", "canary"
MODES = (STABLE, SHADOW, CANARY)
KEPT = 5000  # latencies and scores kept per version: the newest, enough for p99 and score deciles


@dataclass(frozen=True)
class Release:
    model: str
    stable: int
    candidate: int | None = None
    mode: str = STABLE
    share: int = 0  # percent of unversioned requests the candidate answers (canary)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.mode != STABLE and (self.candidate is None or self.candidate == self.stable):
            raise ValueError(f"a {self.mode} release needs a candidate other than the stable version {self.stable}")
        if isinstance(self.share, bool) or not isinstance(self.share, int) or not 0 <= self.share <= 100:
            raise ValueError(f"share {self.share!r}: a whole percentage from 0 to 100")
        if self.mode == CANARY and self.share == 0:
            raise ValueError("a canary release with share 0 sends the candidate nothing: use shadow or stable")


@dataclass(frozen=True)
class Route:
    version: int  # answers the client
    shadow: int | None = None  # also gets the request; its answer is only recorded


def route(release: Release, requested: int | None, draw: float | None = None) -> Route:
    """Where one request goes. ``draw``: a uniform number in [0, 1) (drawn here when not given)."""
    if requested is not None:
        return Route(requested)
    if release.mode == SHADOW:
        return Route(release.stable, shadow=release.candidate)
    if release.mode == CANARY:
        draw = random.random() if draw is None else draw
        return Route(release.candidate if draw * 100 < release.share else release.stable)
    return Route(release.stable)


@dataclass
class VersionRecorder:
    """What one version answered: counts in full, the newest latencies and scores (bounded memory)."""

    requests: int = 0
    errors: int = 0
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    scores: deque = field(default_factory=lambda: deque(maxlen=KEPT))

    def record(self, latency_ms: float, scores: list[float] | None = None, failed: bool = False) -> None:
        self.requests += 1
        self.errors += failed
        self.latencies_ms.append(latency_ms)
        if scores:
            self.scores.extend(scores[:KEPT])

    def snapshot(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "latencies_ms": list(self.latencies_ms),
                "scores": list(self.scores)}
