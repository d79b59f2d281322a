"""Judging one step of a progressive release (shadow or a canary share) from what the guard saw of each version
on the same traffic, in the same window (they share the machine and its load), by statistics with a stated sample
size and confidence, never by one order statistic of a small sample:

- errors (and non-finite scores): the candidate's count against the most that ``max_error_rate`` explains at
  ``confidence`` (exact one-sided binomial test);
- latency: the candidate/stable ratio of each of ``latency_quantiles``, bounded below from order statistics
  (distribution-free); a regression is a lower bound over ``max_latency_ratio``. A percentile is judged only once
  the stable version has the samples its upper bound needs (p99 at 95%: 368), else the step waits;
- the absolute SLO (``max_p99_ms``) as a guard over both versions: the candidate fails it when its p99's lower
  bound is over it; when the stable version's is too, the machine is the problem and the step is held;
- scores: mean shift, and PSI over the stable version's score deciles, each over its threshold and over what
  chance gives two samples of that size (a PSI of 60 scores a side is 0.3 by chance alone).
Pure: the trigger fetches the figures, this decides and says why in one line a check, with numbers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import Any

from hybridflow.exceptions import ConfigError
from hybridflow.utils.bounds import (
    most_explained,
    quantile_lower_bound,
    quantile_upper_bound,
    samples_for_upper_bound,
)
from hybridflow.utils.latency import percentile

PASS, FAIL, WAIT, HOLD = "pass", "fail", "wait", "hold"
# Each bin's count plus this (Jeffreys' prior): an empty decile would make PSI infinite, and a floor share (1e-4)
# made one empty bin of 60 scores worth PSI 0.7 by itself.
PSI_PRIOR = 0.5
MIN_BIN_WIDTH = 0.01  # score units (probabilities): the narrowest decile PSI compares over
MIN_EDGES = 3  # PSI over fewer than 4 such bins says little: the mean shift judges alone
SLO_QUANTILE = 99  # max_p99_ms is a p99 budget


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
    max_latency_ratio: float = 1.5
    latency_quantiles: tuple[int, ...] = (50, 99)
    confidence: float = 0.95
    max_mean_shift: float = 0.05
    max_psi: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.latency_quantiles, list):  # from YAML or a trigger's JSON kwargs
            object.__setattr__(self, "latency_quantiles", tuple(self.latency_quantiles))

    def validate(self, where: str = "serving.release") -> None:
        if not isinstance(self.min_requests, int) or isinstance(self.min_requests, bool) or self.min_requests < 1:
            raise ConfigError(f"{where}.min_requests: {self.min_requests!r}; expected a positive integer")
        for key, low, high in (("max_error_rate", 0.0, 1.0), ("max_p99_ms", 0.0, math.inf),
                               ("max_latency_ratio", 1.0, math.inf), ("max_mean_shift", 0.0, 1.0),
                               ("max_psi", 0.0, math.inf)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high \
                    or math.isnan(value):
                bound = f"in ({low:g}, {high:g}]" if high != math.inf else f"above {low:g}"
                raise ConfigError(f"{where}.{key}: {value!r}; expected a number {bound}")
        value = self.confidence
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.5 <= value < 1:
            raise ConfigError(f"{where}.confidence: {value!r}; expected a probability in [0.5, 1), e.g. 0.95")
        quantiles = self.latency_quantiles
        if not isinstance(quantiles, tuple) or not quantiles or any(
                isinstance(q, bool) or not isinstance(q, int) or not 0 < q < 100 for q in quantiles) \
                or list(quantiles) != sorted(set(quantiles)):
            raise ConfigError(f"{where}.latency_quantiles: {quantiles!r}; give increasing whole percentiles in "
                              "1..99, e.g. [50, 99]")

    @property
    def side_confidence(self) -> float:
        """Each bound of a two-sample ratio at this, so that both hold together at ``confidence`` (Bonferroni)."""
        return (1 + self.confidence) / 2

    @property
    def score_confidence(self) -> float:
        """What chance must not explain before the scores blame the candidate: ``confidence`` shared over the
        step's five kinds of evidence (errors, latency ratios, the SLO, mean shift, PSI), Bonferroni: 99% at 95%."""
        return 1 - (1 - self.confidence) / 5

    def samples_needed(self) -> dict[int, int]:
        """Stable latencies each judged percentile needs before its ratio can be bounded (p99 at 95%: 368)."""
        return {q: samples_for_upper_bound(q, self.side_confidence) for q in self.latency_quantiles}


@dataclass(frozen=True)
class Verdict:
    outcome: str  # pass, fail, hold (the machine, not the candidate) or wait (not enough traffic yet)
    reasons: tuple[str, ...]  # what decided a fail, hold or wait
    figures: dict[str, Any]
    checks: tuple[str, ...] = field(default=())  # one line per check, with its numbers, whatever the outcome

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: lists, not tuples (a trigger event and XCom carry it)."""
        return {**asdict(self), "reasons": list(self.reasons), "checks": list(self.checks)}


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
        return [(count + PSI_PRIOR) / (len(sample) + PSI_PRIOR * len(counts)) for count in counts]

    return sum((a - e) * math.log(a / e) for e, a in zip(shares(expected), shares(actual), strict=True))


class _Checks:
    """The checks' lines and outcomes, gathered as they run."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.by_outcome: dict[str, list[str]] = {FAIL: [], HOLD: [], WAIT: []}

    def add(self, outcome: str, line: str) -> None:
        self.lines.append(f"{outcome}: {line}")
        if outcome != PASS:
            self.by_outcome[outcome].append(line)

    def verdict(self, figures: dict[str, Any]) -> Verdict:
        for outcome in (FAIL, HOLD, WAIT):  # a candidate's own fault first; the machine's; then too few samples
            if self.by_outcome[outcome]:
                return Verdict(outcome, tuple(self.by_outcome[outcome]), figures, tuple(self.lines))
        return Verdict(PASS, (), figures, tuple(self.lines))


def _pct(rate: float) -> str:
    return f"{rate:.2%}"


def _check_errors(checks: _Checks, what: str, stable_bad: tuple[int, int], candidate_bad: tuple[int, int],
                  limits: StepThresholds) -> None:
    """``*_bad``: (count, out of). Over what the rate explains on the candidate alone: fail; on both: hold."""
    (stable_count, stable_n), (count, n) = stable_bad, candidate_bad
    explained = most_explained(n, limits.max_error_rate, limits.confidence)
    line = (f"{what} {count} of {n} {'>' if count > explained else '<='} {explained}, the most a "
            f"{_pct(limits.max_error_rate)} rate explains at {limits.confidence:.0%}")
    if count <= explained:
        checks.add(PASS, line)
    elif stable_n and stable_count > most_explained(stable_n, limits.max_error_rate, limits.confidence):
        checks.add(HOLD, f"{line}; the stable version too ({stable_count} of {stable_n}): the server or the "
                         "machine, not the candidate")
    else:
        checks.add(FAIL, line)


def _check_latency(checks: _Checks, stable: Sequence[float], candidate: Sequence[float], limits: StepThresholds,
                   figures: dict[str, Any]) -> None:
    side = limits.side_confidence
    for q in limits.latency_quantiles:
        needed = samples_for_upper_bound(q, side)
        stable_high = quantile_upper_bound(stable, q, side)
        candidate_low = quantile_lower_bound(candidate, q, side)
        if stable_high is None or candidate_low is None:
            checks.add(WAIT, f"p{q}: {len(stable)} stable latencies of the {needed} its {side:.1%} bound needs")
            continue
        ratio = candidate_low / max(stable_high, 1e-9)
        figures[f"p{q}_ratio_low"] = round(ratio, 3)
        outcome = FAIL if ratio > limits.max_latency_ratio else PASS
        checks.add(outcome, f"p{q} ratio >= {ratio:.2f} {'>' if outcome == FAIL else '<='} "
                            f"{limits.max_latency_ratio:g} ({limits.confidence:.0%}: candidate p{q} >= "
                            f"{candidate_low:.1f} ms of {len(candidate)}, stable p{q} <= {stable_high:.1f} ms "
                            f"of {len(stable)})")
    # The absolute SLO, over both versions: the candidate is blamed only where the stable version is within it on
    # the same machine; a breach on both is the machine's.
    candidate_low = quantile_lower_bound(candidate, SLO_QUANTILE, limits.confidence)
    if candidate_low is None:
        return
    stable_low = quantile_lower_bound(stable, SLO_QUANTILE, limits.confidence)
    stable_high = quantile_upper_bound(stable, SLO_QUANTILE, limits.confidence)
    figures["p99_low_ms"] = round(candidate_low, 3)
    slo = limits.max_p99_ms
    line = (f"p99 >= {candidate_low:.1f} ms {'>' if candidate_low > slo else '<='} SLO {slo:g} ms "
            f"({limits.confidence:.0%} lower bound of {len(candidate)} samples; stable p99 "
            f"{percentile(stable, SLO_QUANTILE) if stable else math.nan:.1f} ms of {len(stable)})")
    if candidate_low <= slo:
        checks.add(PASS, line)
    elif stable_low is not None and stable_low > slo:
        checks.add(HOLD, f"{line}; the stable version's p99 >= {stable_low:.1f} ms is over it too: the machine is "
                         "the problem, not the candidate")
    elif stable_high is not None and stable_high <= slo:
        checks.add(FAIL, f"{line}; the stable version's p99 <= {stable_high:.1f} ms is within it")
    else:
        checks.add(WAIT, f"{line}; the stable version's p99 is neither surely within it nor surely over it: more "
                         "samples tell the machine from the candidate")


def chance_psi(bins: int, n_expected: int, n_actual: int, confidence: float) -> float:
    """The PSI two samples of one distribution reach by chance at ``confidence``: PSI x n1 n2 / (n1 + n2) is about
    chi-square with ``bins - 1`` degrees of freedom (its quantile by Wilson-Hilferty). 60 scores a side over 10
    bins: 0.56; 1000: 0.034. Below it, a PSI is noise whatever ``max_psi`` says."""
    dof = bins - 1
    z = NormalDist().inv_cdf(confidence)
    chi2 = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return chi2 * (1 / n_expected + 1 / n_actual)


def _check_scores(checks: _Checks, baseline: Sequence[float], finite: Sequence[float], limits: StepThresholds,
                  figures: dict[str, Any]) -> None:
    """Mean shift and PSI, each failing only over its threshold and over what chance gives samples this size."""
    n1, n2 = len(baseline), len(finite)
    mean1, mean2 = sum(baseline) / n1, sum(finite) / n2
    shift = abs(mean2 - mean1)
    spread = math.sqrt(sum((v - mean1) ** 2 for v in baseline) / max(n1 - 1, 1) / n1
                       + sum((v - mean2) ** 2 for v in finite) / max(n2 - 1, 1) / n2)
    level = limits.score_confidence
    shift_limit = max(limits.max_mean_shift, NormalDist().inv_cdf((1 + level) / 2) * spread)
    edges = decile_edges(baseline)
    # Fewer than 4 bins a hundredth wide: the stable scores bunch too tightly for a distribution to compare;
    # the mean shift alone judges (a PSI there measures differences nobody acts on).
    index = psi(baseline, finite, edges) if len(edges) >= MIN_EDGES else None
    figures.update(mean_shift=round(shift, 6), psi=None if index is None else round(index, 6))
    checks.add(FAIL if shift > shift_limit else PASS,
               f"mean score shift {shift:.4f} {'>' if shift > shift_limit else '<='} {shift_limit:.4f} "
               f"(max_mean_shift {limits.max_mean_shift:g}, or chance at {level:.0%} for {n2} vs {n1} "
               "scores)")
    if index is not None:
        psi_limit = max(limits.max_psi, chance_psi(len(edges) + 1, n1, n2, level))
        figures["psi_limit"] = round(psi_limit, 6)
        checks.add(FAIL if index > psi_limit else PASS,
                   f"PSI {index:.3f} {'>' if index > psi_limit else '<='} {psi_limit:.3f} over the stable version's "
                   f"score deciles (max_psi {limits.max_psi:g}, or chance at {level:.0%} for {n2} vs "
                   f"{n1} scores)")


def judge(stable: VersionFigures, candidate: VersionFigures, limits: StepThresholds) -> Verdict:
    """The step's verdict: ``wait`` until both versions answered ``min_requests``; then ``fail`` naming every
    check the candidate broke, ``hold`` when the stable version breaks the same absolute limit (the machine),
    ``wait`` while a percentile lacks the samples its bound needs, else ``pass``. Every check's line is in
    ``checks``."""
    figures: dict[str, Any] = {"requests": candidate.requests, "stable_requests": stable.requests}
    if candidate.requests < limits.min_requests or stable.requests < limits.min_requests:
        line = (f"{min(candidate.requests, stable.requests)} of {limits.min_requests} requests needed on each "
                "version so far")
        return Verdict(WAIT, (line,), figures, (f"{WAIT}: {line}",))
    checks = _Checks()
    figures.update(errors=candidate.errors, stable_errors=stable.errors,
                   error_rate=round(candidate.errors / candidate.requests, 6),
                   latency_samples=len(candidate.latencies_ms), stable_latency_samples=len(stable.latencies_ms),
                   p99_ms=round(_p99_ms(candidate.latencies_ms), 3),
                   stable_p99_ms=round(_p99_ms(stable.latencies_ms), 3), confidence=limits.confidence)
    _check_errors(checks, "errors", (stable.errors, stable.requests), (candidate.errors, candidate.requests), limits)
    if candidate.latencies_ms:
        _check_latency(checks, stable.latencies_ms, candidate.latencies_ms, limits, figures)
    finite = [s for s in candidate.scores if math.isfinite(s)]
    baseline = [s for s in stable.scores if math.isfinite(s)]
    if len(finite) < len(candidate.scores):
        _check_errors(checks, "non-finite scores", (len(stable.scores) - len(baseline), len(stable.scores)),
                      (len(candidate.scores) - len(finite), len(candidate.scores)), limits)
    if finite and baseline:
        _check_scores(checks, baseline, finite, limits, figures)
    elif not finite:
        checks.add(FAIL, "no score to compare with the stable version's")
    return checks.verdict(figures)


def judge_gate(candidate_ms: Sequence[float], candidate_failed: int, slo_p99_ms: float, limits: StepThresholds,
               baseline_ms: Sequence[float] | None = None, baseline_failed: int = 0) -> Verdict:
    """The latency gate before any real traffic: the new version alone under a short load, or beside the serving
    version (``baseline_ms``) under the same load at the same time. Alone, it fails only on a failed request or
    when its p99's lower bound is over the SLO; beside the serving version, also on a latency ratio's bound over
    ``max_latency_ratio``, and a breach of the SLO (or failed requests) on both is the machine's: held. A
    percentile its samples cannot bound is left unjudged (said in its line), never a failure."""
    checks = _Checks()
    figures: dict[str, Any] = {"latency_samples": len(candidate_ms), "failed": candidate_failed}
    if candidate_failed:
        line = f"{candidate_failed} requests failed"
        checks.add(HOLD if baseline_failed else FAIL,
                   f"{line}; the serving version's too ({baseline_failed}): the server or the machine"
                   if baseline_failed else line)
    limits = replace(limits, max_p99_ms=slo_p99_ms)
    if baseline_ms is not None and candidate_ms:
        figures["baseline_latency_samples"] = len(baseline_ms)
        _check_latency(checks, baseline_ms, candidate_ms, limits, figures)
    elif candidate_ms:
        low = quantile_lower_bound(candidate_ms, SLO_QUANTILE, limits.confidence)
        figures["p99_low_ms"] = None if low is None else round(low, 3)
        over = low is not None and low > slo_p99_ms
        checks.add(FAIL if over else PASS, f"p99 >= {low if low is not None else math.nan:.1f} ms "
                                           f"{'>' if over else '<='} SLO {slo_p99_ms:g} ms ({limits.confidence:.0%} "
                                           f"lower bound of {len(candidate_ms)} requests)")
    else:
        checks.add(FAIL, "no request was answered")
    verdict = checks.verdict(figures)
    if verdict.outcome == WAIT:  # a percentile too few requests bound: not judged, not failed
        return Verdict(PASS, (), figures, verdict.checks)
    return verdict


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
                        f"(SLO {report.get('slo_p99_ms')} ms)" + (f"; {latency['decision']}." if latency.get("decision")
                                                                  else "."))
    for step in release.get("steps") or []:
        figures = step.get("figures") or {}
        label = "shadow" if step.get("mode") == "shadow" else f"canary {step.get('share')}%"
        lines.append(f"| {label} | {step.get('outcome')} | {figures.get('requests', '-')} | "
                     f"{figures.get('error_rate', '-')} | {figures.get('p99_ms', '-')} "
                     f"({figures.get('stable_p99_ms', '-')}) | {figures.get('mean_shift', '-')} | "
                     f"{figures.get('psi', '-') if figures.get('psi') is not None else '-'} |")
    if not release.get("steps"):
        lines.append("| (no real traffic: direct release) | - | - | - | - | - | - |")
    if release.get("decision"):
        lines.append(f"\nLast step: {release['decision']}")
    if release.get("no_traffic"):
        lines.append("\nA step saw too little traffic to judge (no_traffic: promote).")
    lines += ["", f"**{PROMOTE}**: version {version} takes every request and version {previous} is unloaded. "
              f"**{ROLL_BACK}**: every request goes back to version {previous} and version {version} is unloaded.",
              f"Nobody answering within {timeout_s / 3600:g} h rolls it back."]
    return {"subject": f"Promote {model} version {version}? (serving: version {previous})", "body": "\n".join(lines)}
