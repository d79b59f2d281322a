"""Judging one step of a progressive release (shadow or a canary share) from what the guard saw of each version on
the same traffic: the candidate passes only when it answered enough requests, few enough failed, its p99 stays in
budget, and its scores keep the stable version's distribution (mean shift, and PSI over the stable version's score
deciles). Pure: the trigger fetches the figures, this decides and says why, with the figure and the threshold.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hybridflow.exceptions import ConfigError
from hybridflow.utils.latency import percentile

PASS, FAIL, WAIT = "pass", "fail", "wait"
PSI_FLOOR = 1e-4  # an empty decile would make PSI infinite: count it as this share instead
MIN_BIN_WIDTH = 0.01  # score units (probabilities): the narrowest decile PSI compares over
MIN_EDGES = 3  # PSI over fewer than 4 such bins says little: the mean shift judges alone


@dataclass(frozen=True)
class VersionFigures:
    """One version's answers during a step: requests, failed ones, latencies and the scores it returned."""

    requests: int
    errors: int
    latencies_ms: Sequence[float]
    scores: Sequence[float]


@dataclass(frozen=True)
class StepThresholds:
    """What a candidate must show in one step (``serving.release`` in the pipeline config)."""

    min_requests: int = 200
    max_error_rate: float = 0.01
    max_p99_ms: float = 50.0
    max_mean_shift: float = 0.05
    max_psi: float = 0.2

    def validate(self, where: str = "serving.release") -> None:
        if not isinstance(self.min_requests, int) or isinstance(self.min_requests, bool) or self.min_requests < 1:
            raise ConfigError(f"{where}.min_requests: {self.min_requests!r}; expected a positive integer")
        for key, low, high in (("max_error_rate", 0.0, 1.0), ("max_p99_ms", 0.0, math.inf),
                               ("max_mean_shift", 0.0, 1.0), ("max_psi", 0.0, math.inf)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high \
                    or math.isnan(value):
                bound = f"in ({low:g}, {high:g}]" if high != math.inf else f"above {low:g}"
                raise ConfigError(f"{where}.{key}: {value!r}; expected a number {bound}")


@dataclass(frozen=True)
class Verdict:
    outcome: str  # pass, fail or wait (not enough traffic yet)
    reasons: tuple[str, ...]
    figures: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _p99_ms(latencies_ms: Sequence[float]) -> float:
    """NaN where no request was answered: no p99 is not within any limit."""
    return percentile(latencies_ms, 99) if latencies_ms else math.nan


def decile_edges(sample: Sequence[float], min_gap: float = MIN_BIN_WIDTH) -> list[float]:
    """The inner edges splitting the stable version's scores into tenths, an edge closer than ``min_gap`` to the
    one before it dropped: when the stable scores bunch up (a quiet input, a saturated model) deciles a thousandth
    apart would turn score differences nobody acts on into a huge PSI (measured: 1.68 for a mean shift of 0.0017)."""
    edges: list[float] = []
    for edge in (percentile(sample, 10 * k) for k in range(1, 10)):
        if not edges or edge - edges[-1] >= min_gap:
            edges.append(edge)
    return edges


def psi(expected: Sequence[float], actual: Sequence[float], edges: Sequence[float]) -> float:
    """Population stability index of ``actual`` against ``expected`` over the bins ``edges`` make."""
    def shares(sample: Sequence[float]) -> list[float]:
        counts = [0] * (len(edges) + 1)
        for value in sample:
            counts[bisect.bisect_right(edges, value)] += 1
        return [max(count / len(sample), PSI_FLOOR) for count in counts]

    return sum((a - e) * math.log(a / e) for e, a in zip(shares(expected), shares(actual), strict=True))


def judge(stable: VersionFigures, candidate: VersionFigures, limits: StepThresholds) -> Verdict:
    """The step's verdict: ``wait`` until both versions answered ``min_requests``; then ``fail`` naming every figure
    over its threshold, else ``pass``."""
    figures: dict[str, Any] = {"requests": candidate.requests, "stable_requests": stable.requests}
    if candidate.requests < limits.min_requests or stable.requests < limits.min_requests:
        return Verdict(WAIT, (f"{min(candidate.requests, stable.requests)} of {limits.min_requests} requests "
                              "needed on each version so far",), figures)
    reasons = []
    error_rate = candidate.errors / candidate.requests
    p99 = _p99_ms(candidate.latencies_ms)
    figures.update(error_rate=round(error_rate, 6), p99_ms=round(p99, 3),
                   stable_p99_ms=round(_p99_ms(stable.latencies_ms), 3))
    if error_rate > limits.max_error_rate:
        reasons.append(f"error rate {error_rate:.2%} > {limits.max_error_rate:.2%}")
    if not p99 <= limits.max_p99_ms:
        reasons.append(f"p99 {p99:.1f} ms > {limits.max_p99_ms:g} ms")
    finite = [s for s in candidate.scores if math.isfinite(s)]
    baseline = [s for s in stable.scores if math.isfinite(s)]
    if len(finite) < len(candidate.scores):
        reasons.append(f"{len(candidate.scores) - len(finite)} non-finite scores")
    if finite and baseline:
        shift = abs(sum(finite) / len(finite) - sum(baseline) / len(baseline))
        edges = decile_edges(baseline)
        # Fewer than 4 bins a hundredth wide: the stable scores bunch too tightly for a distribution to compare;
        # the mean shift alone judges (a PSI there measures differences nobody acts on).
        index = psi(baseline, finite, edges) if len(edges) >= MIN_EDGES else None
        figures.update(mean_shift=round(shift, 6), psi=None if index is None else round(index, 6))
        if shift > limits.max_mean_shift:
            reasons.append(f"mean score shift {shift:.4f} > {limits.max_mean_shift:g}")
        if index is not None and index > limits.max_psi:
            reasons.append(f"PSI {index:.3f} > {limits.max_psi:g} over the stable version's score deciles")
    elif not finite:
        reasons.append("no score to compare with the stable version's")
    return Verdict(FAIL if reasons else PASS, tuple(reasons), figures)


def canary_steps(steps: Any, where: str = "serving.release.canary_steps") -> tuple[int, ...]:
    """Canary shares in percent: increasing whole numbers in (0, 100], ending at 100 (the promotion)."""
    if not isinstance(steps, list | tuple) or not steps:
        raise ConfigError(f"{where}: {steps!r}; give increasing percentages ending at 100, e.g. [10, 50, 100]")
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 < s <= 100 for s in steps):
        raise ConfigError(f"{where}: {list(steps)!r}; every step is a whole percentage in 1..100")
    if list(steps) != sorted(set(steps)) or steps[-1] != 100:
        raise ConfigError(f"{where}: {list(steps)!r}; steps must increase and end at 100, e.g. [10, 50, 100]")
    return tuple(steps)


# --- Human approval (deploy=ask): what the person sees, and what their answer means ------------------------------

PROMOTE, ROLL_BACK = "Promote", "Roll back"
APPROVAL_OPTIONS = (PROMOTE, ROLL_BACK)


@dataclass(frozen=True)
class ApprovalAnswer:
    promote: bool
    by: str | None  # None: nobody answered in time, Airflow chose the default (roll back)
    at: str | None

    @property
    def timed_out(self) -> bool:
        return self.by is None

    def as_dict(self) -> dict[str, Any]:
        return {"choice": PROMOTE if self.promote else ROLL_BACK, "by": self.by, "at": self.at,
                "timed_out": self.timed_out}


def approval_answer(payload: Any) -> ApprovalAnswer:
    """The approval task's result (the standard provider's HITL payload: ``chosen_options``,
    ``responded_by_user`` {id, name} or None when the timeout chose the default, ``responded_at``)."""
    if not isinstance(payload, dict):
        raise ValueError(f"the approval task returned {payload!r}, not its answer; clear it to ask again")
    chosen = payload.get("chosen_options")
    if not isinstance(chosen, list) or len(chosen) != 1 or chosen[0] not in APPROVAL_OPTIONS:
        raise ValueError(f"the approval's chosen_options are {chosen!r}; expected one of {list(APPROVAL_OPTIONS)}")
    user = payload.get("responded_by_user")
    by = None if not user else str(user.get("name") or user.get("id")) if isinstance(user, dict) else str(user)
    at = payload.get("responded_at")
    return ApprovalAnswer(promote=chosen[0] == PROMOTE, by=by,
                          at=at.isoformat() if hasattr(at, "isoformat") else None if at is None else str(at))


def approval_request(report: dict[str, Any], timeout_s: float) -> dict[str, str]:
    """The subject and Markdown body a person decides on: every step the release passed, with its figures, and
    what each option does."""
    model, version, previous = report["model"], report["version"], report["previous_version"]
    release = report.get("release") or {}
    latency, smoke = report.get("latency") or {}, report.get("smoke") or {}
    lines = [f"Version **{version}** of `{model}` passed its checks against version {previous}, which serves now.",
             "", "| step | outcome | requests | error rate | p99 ms (stable) | mean shift | PSI |",
             "|---|---|---|---|---|---|---|"]
    if smoke:
        lines.insert(1, f"Smoke set: {smoke.get('rows')} rows, max abs error {smoke.get('max_abs_error')} "
                        f"(atol {smoke.get('atol')}).")
    if latency:
        lines.insert(2, f"Latency gate: p99 {latency.get('p99_ms')} ms over {latency.get('requests')} requests "
                        f"(SLO {report.get('slo_p99_ms')} ms).")
    for step in release.get("steps") or []:
        figures = step.get("figures") or {}
        label = "shadow" if step.get("mode") == "shadow" else f"canary {step.get('share')}%"
        lines.append(f"| {label} | {step.get('outcome')} | {figures.get('requests', '-')} | "
                     f"{figures.get('error_rate', '-')} | {figures.get('p99_ms', '-')} "
                     f"({figures.get('stable_p99_ms', '-')}) | {figures.get('mean_shift', '-')} | "
                     f"{figures.get('psi', '-') if figures.get('psi') is not None else '-'} |")
    if not release.get("steps"):
        lines.append("| (no real traffic: direct release) | - | - | - | - | - | - |")
    if release.get("no_traffic"):
        lines.append("\nA step saw too little traffic to judge (no_traffic: promote).")
    lines += ["", f"**{PROMOTE}**: version {version} takes every request and version {previous} is unloaded. "
              f"**{ROLL_BACK}**: every request goes back to version {previous} and version {version} is unloaded.",
              f"Nobody answering within {timeout_s / 3600:g} h rolls it back."]
    return {"subject": f"Promote {model} version {version}? (serving: version {previous})", "body": "\n".join(lines)}
