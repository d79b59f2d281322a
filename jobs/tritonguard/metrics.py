"""The guard's Prometheus metrics, per model and version: requests, errors, refusals by reason, latency.

Label values come from request paths, so a client could mint new series at will (random model names or version
numbers): a model or version the server does not know is labelled ``unknown``, and past ``MAX_SERIES`` label sets
new ones are labelled ``other``; the scrape stays bounded whatever clients send.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_SERIES = 500
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GuardMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tritonguard_requests", "Infer requests forwarded to Triton, by the version that "
                                "answered", ["model", "version", "protocol"], registry=self.registry)
        self.errors = Counter("tritonguard_errors", "Forwarded infer requests Triton answered with an error or "
                              "never answered", ["model", "version", "protocol"], registry=self.registry)
        self.refusals = Counter("tritonguard_refusals", "Requests the guard refused before Triton saw them",
                                ["model", "protocol", "reason"], registry=self.registry)
        self.latency = Histogram("tritonguard_request_duration_seconds", "Infer latency through the guard, "
                                 "Triton's answer included", ["model", "version", "protocol"],
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.shadow_dropped = Counter("tritonguard_shadow_dropped", "Shadow copies not sent because too many were "
                                      "in flight", ["model"], registry=self.registry)
        self.share = Gauge("tritonguard_release_share_percent", "Percent of unversioned requests each version of a "
                           "released model answers", ["model", "version", "role"], registry=self.registry)
        self.upstream_down = Counter("tritonguard_upstream_unreachable", "Requests answered 503 because Triton "
                                     "stayed unreachable past the wait budget", registry=self.registry)
        self.series: set[tuple[str, ...]] = set()

    def bounded(self, *labels: str) -> tuple[str, ...]:
        """``labels`` while the number of label sets stays under MAX_SERIES, else ``other`` for each."""
        if labels in self.series:
            return labels
        if len(self.series) >= MAX_SERIES:
            return ("other",) * len(labels)
        self.series.add(labels)
        return labels

    def observe(self, model: str, version: str, protocol: str, seconds: float, failed: bool) -> None:
        labels = self.bounded(model, version, protocol)
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)
        if failed:
            self.errors.labels(*labels).inc()

    def refused(self, model: str, protocol: str, reason: str) -> None:
        self.refusals.labels(*self.bounded(model, protocol, reason)).inc()

    def released(self, model: str, stable: int, candidate: int | None, stable_share: int) -> None:
        """The split now; the versions of the previous release are removed, not left at their last share."""
        self.cleared(model)
        self.share.labels(model, str(stable), "stable").set(stable_share)
        if candidate is not None:
            self.share.labels(model, str(candidate), "candidate").set(100 - stable_share)

    def cleared(self, model: str) -> None:
        for labels in [key for key in self.share._metrics if key[0] == model]:  # noqa: SLF001
            self.share.remove(*labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
