"""A model's release state in the guard, and what each version answered while it holds.

``stable``: one version serves. ``shadow``: the candidate also gets a copy of each request that names no version;
its answer is compared, never returned. ``canary``: the candidate answers ``share`` percent of the requests that
name no version. A request naming a version always gets that version. The split is drawn per request, so it needs
no state beyond the release itself and holds on any number of guard processes.
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

STABLE, SHADOW, CANARY = "stable", "shadow", "canary"
MODES = (STABLE, SHADOW, CANARY)
KEPT = 5000  # latencies and scores kept per version: the newest, enough for p99 and score deciles
SCORE_DTYPES = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


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


def release_from_request(model: str, document: object) -> Release:
    """A release from the admin API's JSON (``{"stable", "candidate", "mode", "share"}``); ValueError names the
    field and what it takes."""
    if not isinstance(document, dict):
        raise ValueError('the body must be a JSON object such as {"stable": 1, "candidate": 2, "mode": "canary", '
                         '"share": 10}')
    unknown = sorted(set(document) - {"stable", "candidate", "mode", "share"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; give stable, candidate, mode and share")
    for key in ("stable", "candidate"):
        value = document.get(key)
        if (key == "stable" or value is not None) and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63):
            raise ValueError(f"{key}: {value!r}; give a version number (a positive integer)")
    return Release(model, document["stable"], document.get("candidate"), document.get("mode", STABLE),
                   document.get("share", 0))


def release_as_dict(release: Release) -> dict:
    return {"stable": release.stable, "candidate": release.candidate, "mode": release.mode, "share": release.share}


class ReleaseBook:
    """Every model's release, each with a generation that changes whenever it is set (the figures of a step are
    those since its generation began), kept in ``state_file`` so a restarted guard routes as before."""

    def __init__(self, state_file: Path | None = None):
        self.state_file = state_file
        self.releases: dict[str, Release] = {}
        self.generations: dict[str, int] = {}
        self.since: dict[str, float] = {}
        self.recorders: dict[tuple[str, int], VersionRecorder] = {}
        if state_file and state_file.exists():
            for model, entry in json.loads(state_file.read_text()).items():
                self.releases[model] = release_from_request(model, entry["release"])
                self.generations[model] = int(entry["generation"])
                self.since[model] = time.time()

    def get(self, model: str) -> Release | None:
        return self.releases.get(model)

    def set(self, release: Release) -> int:
        model = release.model
        self.generations[model] = self.generations.get(model, 0) + 1
        self.releases[model] = release
        self.since[model] = time.time()
        self.recorders = {key: value for key, value in self.recorders.items() if key[0] != model}
        self.save()
        return self.generations[model]

    def clear(self, model: str) -> bool:
        if self.releases.pop(model, None) is None:
            return False
        self.generations[model] += 1
        self.recorders = {key: value for key, value in self.recorders.items() if key[0] != model}
        self.save()
        return True

    def record(self, model: str, version: int, latency_ms: float, scores: list[float] | None, failed: bool) -> None:
        release = self.releases.get(model)
        if release is None or release.mode == STABLE or version not in (release.stable, release.candidate):
            return  # figures only serve a release step: nothing to compare in a stable release
        self.recorders.setdefault((model, version), VersionRecorder()).record(latency_ms, scores, failed)

    def describe(self, model: str) -> dict | None:
        release = self.releases.get(model)
        if release is None:
            return None
        return {"model": model, "release": release_as_dict(release), "generation": self.generations[model],
                "since": self.since[model]}

    def figures(self, model: str) -> dict | None:
        """The release and what each of its versions answered since the current generation began."""
        described = self.describe(model)
        if described is None:
            return None
        release = self.releases[model]
        for role, version in (("stable", release.stable), ("candidate", release.candidate)):
            recorder = self.recorders.get((model, version)) if version is not None else None
            described[role] = (recorder or VersionRecorder()).snapshot()
        return described

    def save(self) -> None:
        if self.state_file is None:
            return
        state = {model: {"release": release_as_dict(release), "generation": self.generations[model]}
                 for model, release in self.releases.items()}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        partial.write_text(json.dumps(state, indent=1))
        os.replace(partial, self.state_file)  # a guard killed mid-write keeps the previous state whole


def scores_from_response(payload: bytes, header_length: str | None, encoding: str | None = None) -> list[float]:
    """The first output's values of a KServe v2 infer response (JSON, or JSON header plus binary tail; gzip or
    deflate as the client asked); [] when there is none to read (an error, a non-float output)."""
    try:
        if encoding in ("gzip", "deflate"):  # the header length counts the uncompressed bytes
            payload = zlib.decompress(payload, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        if header_length is None:
            head, tail = payload, b""
        else:
            cut = int(header_length)
            head, tail = payload[:cut], payload[cut:]
        outputs = json.loads(head).get("outputs") or []
        first = outputs[0]
        datatype = first.get("datatype")
        if "data" in first:
            return [float(v) for v in first["data"] if isinstance(v, (int, float)) and not isinstance(v, bool)]
        size = (first.get("parameters") or {}).get("binary_data_size")
        if datatype not in SCORE_DTYPES or not isinstance(size, int) or size > len(tail):
            return []
        return np.frombuffer(tail[:size], SCORE_DTYPES[datatype]).astype(float).tolist()
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, zlib.error):
        return []
