"""Judging a release step, by tables: enough traffic, errors by count, latency ratios and the SLO by
distribution-free bounds (held when the stable version breaks the SLO too), and the score distribution against the
stable version's (mean shift, PSI over its deciles)."""

from __future__ import annotations

import math
import random
import re
from datetime import UTC, datetime

import pytest
from hybridflow.exceptions import ConfigError
from hybridflow.utils.release import (
    FAIL,
    HOLD,
    PASS,
    PROMOTE,
    ROLL_BACK,
    WAIT,
    StepThresholds,
    VersionFigures,
    approval_answer,
    approval_request,
    canary_steps,
    chance_psi,
    decile_edges,
    judge,
    judge_gate,
    psi,
)

LIMITS = StepThresholds(min_requests=200, max_error_rate=0.01, max_p99_ms=50, max_mean_shift=0.05, max_psi=0.2)


def scores(n: int, mean: float, seed: int, spread: float = 0.1) -> list[float]:
    draw = random.Random(seed)
    return [min(1.0, max(0.0, draw.gauss(mean, spread))) for _ in range(n)]


def latencies(n: int, seed: int, median_ms: float = 10.0, hiccups: tuple[float, ...] = ()) -> list[float]:
    """A loaded machine's latencies: lognormal around ``median_ms`` (p99 about 2.5x it), plus ``hiccups``."""
    draw = random.Random(seed)
    values = [median_ms * math.exp(draw.gauss(0, 0.4)) for _ in range(n - len(hiccups))] + list(hiccups)
    draw.shuffle(values)
    return values


def figures(n: int = 1000, errors: int = 0, median_ms: float = 10.0, mean: float = 0.4, seed: int = 1,
            hiccups: tuple[float, ...] = (), extra: list[float] | None = None) -> VersionFigures:
    return VersionFigures(requests=n, errors=errors, latencies_ms=latencies(n - errors, seed, median_ms, hiccups),
                          scores=scores(n, mean, seed) + (extra or []))


STABLE = figures(seed=1)


@pytest.mark.parametrize(("candidate", "outcome", "reasons"), [
    (figures(seed=2), PASS, []),  # the same model on other requests: same distribution
    (figures(n=150, seed=2), WAIT, ["150 of 200 requests needed on each version so far"]),
    (figures(errors=30, seed=2), FAIL, ["errors 30 of 1000 > 15, the most a 1.00% rate explains at 95%"]),
    (figures(errors=15, seed=2), PASS, []),  # 1.5%: within what a 1% rate gives by chance in 1000 requests
    (figures(seed=2, hiccups=(400.0,) * 5), PASS, []),  # five slow requests of 1000: no evidence
    (figures(seed=2, hiccups=(400.0,) * 40), FAIL, ["p99 ratio >= ", "p99 >= 400.0 ms > SLO 50 ms"]),
    (figures(seed=2, median_ms=30), FAIL, ["p50 ratio >= 2.", "p99 ratio >= 2.", "p99 >= "]),  # 3x slower
    (figures(seed=2, median_ms=12), PASS, []),  # 1.2x: within max_latency_ratio
    (figures(mean=0.55, seed=2), FAIL, ["mean score shift", "PSI"]),
    (figures(mean=0.42, seed=2), PASS, []),  # a small shift within both limits
    (figures(seed=2, extra=[math.nan] * 3), PASS, []),  # 3 of 1003 scores: what a 1% rate explains
    (figures(seed=2, extra=[math.nan] * 40), FAIL, ["non-finite scores 40 of 1040 > "]),
    (VersionFigures(1000, 0, latencies(1000, 2), []), FAIL, ["no score to compare"]),
    (VersionFigures(1000, 1000, [], []), FAIL, ["errors 1000 of 1000", "no score"]),  # none answered
    (figures(errors=500, median_ms=90, mean=0.9, seed=3),
     FAIL, ["errors", "p50 ratio", "p99 ratio", "p99 >= ", "mean score shift", "PSI"]),
])
def test_a_step_passes_waits_or_fails_naming_the_figure_and_its_threshold(candidate, outcome, reasons):
    verdict = judge(STABLE, candidate, LIMITS)
    assert verdict.outcome == outcome, verdict
    assert len(verdict.reasons) == len(reasons), verdict.reasons
    for reason, expected in zip(verdict.reasons, reasons, strict=True):
        assert reason.startswith(expected), verdict.reasons
    if outcome != WAIT and candidate.latencies_ms:  # every check says why in numbers, whatever the outcome
        assert any(line.startswith("pass: p50 ratio >= ") or line.startswith("fail: p50 ratio >= ")
                   for line in verdict.checks), verdict.checks


# The case: at a canary 50% step, 83 requests each; the identical candidate's p99 of 83 (its second-largest
# value) was 55.8 ms against the stable version's 22.5 ms on a loaded machine, and it was rolled back.
LOADED_83 = StepThresholds(min_requests=50, max_p99_ms=50)
STABLE_83 = VersionFigures(83, 0, latencies(83, 11, median_ms=8, hiccups=(22.5,)), scores(83, 0.4, 11))
IDENTICAL_83 = VersionFigures(83, 0, latencies(83, 12, median_ms=8, hiccups=(55.8, 52.0)), scores(83, 0.4, 12))


def test_83_requests_never_roll_back_an_identical_candidate_for_two_slow_requests():
    verdict = judge(STABLE_83, IDENTICAL_83, LOADED_83)
    assert verdict.figures["p99_ms"] == 55.8  # the order statistic that decided before
    # p50 is bounded from 83 samples and passes; p99's ratio waits for the samples its bound needs; the SLO's
    # lower bound (the 80th of 83) is no slow request.
    assert verdict.outcome == WAIT, verdict
    assert verdict.reasons == ("p99: 83 stable latencies of the 368 its 97.5% bound needs",)
    assert any(line.startswith("pass: p50 ratio >= ") for line in verdict.checks), verdict.checks
    assert any(line.startswith("pass: p99 >= ") and "<= SLO 50 ms" in line for line in verdict.checks)
    # with the samples p99 needs, the same machine and model pass
    stable = VersionFigures(400, 0, latencies(400, 13, median_ms=8, hiccups=(22.5, 40.0)), scores(400, 0.4, 13))
    candidate = VersionFigures(400, 0, latencies(400, 14, median_ms=8, hiccups=(55.8, 61.0, 70.0)),
                               scores(400, 0.4, 14))
    assert judge(stable, candidate, LOADED_83).outcome == PASS


def test_83_requests_roll_back_a_clearly_slower_candidate_at_once():
    slow = VersionFigures(83, 0, latencies(83, 12, median_ms=24), scores(83, 0.4, 12))  # 3x the stable's
    verdict = judge(STABLE_83, slow, LOADED_83)
    assert verdict.outcome == FAIL, verdict
    assert verdict.reasons[0].startswith("p50 ratio >= ") and "> 1.5 (95%: candidate p50 >= " in verdict.reasons[0]
    assert "of 83, stable p50 <= " in verdict.reasons[0]
    assert verdict.figures["p50_ratio_low"] > 1.5


def test_both_versions_over_the_slo_hold_the_step_instead_of_blaming_the_candidate():
    stable = figures(seed=1, median_ms=60)  # the machine: both slow alike
    verdict = judge(stable, figures(seed=2, median_ms=60), LIMITS)
    assert verdict.outcome == HOLD, verdict
    assert verdict.reasons[0].startswith("p99 >= ") and "the machine is the problem" in verdict.reasons[0]
    # over the SLO and slower than the stable version too: the candidate's own fault
    assert judge(stable, figures(seed=2, median_ms=200), LIMITS).outcome == FAIL
    # a candidate over the SLO next to a stable version within it: the candidate's fault
    assert judge(STABLE, figures(seed=2, median_ms=40), LIMITS).reasons[-1].startswith("p99 >= ")
    # next to a stable version that may or may not be over it: more samples before anyone is blamed
    verdict = judge(figures(n=300, seed=1, median_ms=22), figures(n=300, seed=2, median_ms=25), LIMITS)
    assert verdict.outcome == WAIT and "neither surely within it nor surely over it" in verdict.reasons[-1], verdict


def test_errors_on_both_versions_hold_the_step():
    verdict = judge(figures(seed=1, errors=100), figures(seed=2, errors=100), LIMITS)
    assert verdict.outcome == HOLD and "the stable version too (100 of 1000)" in verdict.reasons[0], verdict


def test_a_stable_version_without_traffic_keeps_the_step_waiting():
    verdict = judge(figures(n=10), figures(seed=2), LIMITS)
    assert verdict.outcome == WAIT and verdict.figures == {"requests": 1000, "stable_requests": 10}


@pytest.mark.parametrize(("bins", "n1", "n2", "expected"), [(10, 60, 60, 0.563), (10, 1000, 1000, 0.0338),
                                                           (10, 200, 50, 0.423), (4, 100, 100, 0.156)])
def test_the_psi_chance_gives_two_samples_of_one_distribution(bins, n1, n2, expected):
    assert chance_psi(bins, n1, n2, 0.95) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("seed", range(20))
def test_scores_of_one_model_on_small_samples_are_no_shift(seed):
    """The benchmark's first finding: 50 to 120 scores a side of one model gave PSI 0.45 > max_psi 0.2 by chance
    alone (a false rollback); 2000 of a model shifted by 0.05 still fail."""
    draw = random.Random(seed)
    n1, n2 = draw.randint(50, 120), draw.randint(50, 120)
    stable = VersionFigures(n1, 0, latencies(n1, seed), scores(n1, 0.4, seed * 2))
    candidate = VersionFigures(n2, 0, latencies(n2, seed + 1), scores(n2, 0.4, seed * 2 + 1))
    verdict = judge(stable, candidate, StepThresholds(min_requests=50))
    assert not [r for r in verdict.reasons if "PSI" in r or "mean score" in r], verdict
    shifted = judge(VersionFigures(2000, 0, latencies(2000, 1), scores(2000, 0.4, 1)),
                    VersionFigures(2000, 0, latencies(2000, 2), scores(2000, 0.48, 2)), StepThresholds())
    assert shifted.outcome == FAIL and shifted.reasons[0].startswith("mean score shift 0.0"), shifted


@pytest.mark.parametrize("seed", range(20))
def test_identical_versions_on_a_noisy_machine_are_not_rolled_back(seed):
    """Samples of one distribution with heavy hiccups (1% of requests 5-20x slower): at 200 to 2000 requests a
    version, never a fail."""
    draw = random.Random(seed)
    n_stable, n_candidate = draw.randint(200, 2000), draw.randint(200, 2000)

    def noisy(n: int, salt: int) -> VersionFigures:
        values = latencies(n, seed * 100 + salt)
        values = [v * draw.uniform(5, 20) if draw.random() < 0.01 else v for v in values]
        return VersionFigures(n, 0, values, scores(n, 0.4, seed * 100 + salt))

    verdict = judge(noisy(n_stable, 1), noisy(n_candidate, 2), StepThresholds(min_requests=200, max_p99_ms=10**3))
    assert verdict.outcome in (PASS, WAIT), verdict


def test_psi_is_zero_for_one_distribution_and_grows_with_the_shift():
    base = scores(5000, 0.4, 1)
    edges = decile_edges(base)
    assert psi(base, base, edges) == pytest.approx(0, abs=1e-9)
    shifts = [psi(base, scores(5000, 0.4 + d, 2), edges) for d in (0.0, 0.02, 0.05, 0.1)]
    assert shifts == sorted(shifts) and shifts[0] < 0.02 and shifts[-1] > 0.5
    # every score in one decile: empty bins count as a small share, not an infinite index
    assert math.isfinite(psi(base, [0.0] * 100, edges))


def test_bunched_stable_scores_are_judged_by_the_mean_shift_alone():
    bunched = [0.5 + i * 1e-6 for i in range(1000)]  # every stable score within 0.001
    assert decile_edges(bunched) == [bunched[99]]  # the other deciles lie closer than MIN_BIN_WIDTH to it
    # Over raw deciles a nudge nobody acts on reads as a huge PSI (measured on the demo: 1.68 for a shift of 0.0017).
    nudged = [score + 0.0017 for score in bunched]
    assert psi(bunched, nudged, decile_edges(bunched, min_gap=0)) > 1
    latencies = [1.0] * 1000
    verdict = judge(VersionFigures(1000, 0, latencies, bunched), VersionFigures(1000, 0, latencies, nudged), LIMITS)
    assert verdict.outcome == PASS and verdict.figures["psi"] is None
    assert verdict.figures["mean_shift"] == pytest.approx(0.0017)
    moved = [score + 0.1 for score in bunched]  # a real shift still fails, on the mean
    verdict = judge(VersionFigures(1000, 0, latencies, bunched), VersionFigures(1000, 0, latencies, moved), LIMITS)
    assert verdict.outcome == FAIL and verdict.reasons == (
        "mean score shift 0.1000 > 0.0500 (max_mean_shift 0.05, or chance at 99% for 1000 vs 1000 scores)",)


@pytest.mark.parametrize(("steps", "expected"), [
    ([10, 50, 100], (10, 50, 100)), ([100], (100,)), ((1, 100), (1, 100)),
])
def test_canary_steps_increase_to_100(steps, expected):
    assert canary_steps(steps) == expected


@pytest.mark.parametrize(("steps", "message"), [
    ([], "give increasing percentages ending at 100"), (None, "give increasing percentages"),
    ("10,50,100", "give increasing percentages"), ([10, 50], "must increase and end at 100"),
    ([50, 10, 100], "must increase and end at 100"), ([10, 10, 100], "must increase and end at 100"),
    ([0, 100], "every step is a whole percentage in 1..100"), ([10, 101], "every step is a whole percentage"),
    ([10.5, 100], "every step is a whole percentage"), ([True, 100], "every step is a whole percentage"),
    ([-5, 100], "every step is a whole percentage"), (["10", 100], "every step is a whole percentage"),
])
def test_bad_canary_steps_are_refused_naming_the_field_and_the_fix(steps, message):
    with pytest.raises(ConfigError, match=r"^serving\.release\.canary_steps: ") as refused:
        canary_steps(steps)
    assert message in str(refused.value)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("min_requests", 0, "serving.release.min_requests: 0; expected a positive integer"),
    ("min_requests", 2.5, "min_requests: 2.5; expected a positive integer"),
    ("min_requests", True, "min_requests: True; expected a positive integer"),
    ("max_error_rate", 0, "max_error_rate: 0; expected a number in (0, 1]"),
    ("max_error_rate", 1.5, "max_error_rate: 1.5; expected a number in (0, 1]"),
    ("max_p99_ms", -1, "max_p99_ms: -1; expected a number above 0"),
    ("max_p99_ms", math.nan, "max_p99_ms: nan; expected a number above 0"),
    ("max_psi", "0.2", "max_psi: '0.2'; expected a number above 0"),
    ("max_mean_shift", None, "max_mean_shift: None; expected a number in (0, 1]"),
    ("max_latency_ratio", 1, "max_latency_ratio: 1; expected a number above 1"),
    ("max_latency_ratio", "2", "max_latency_ratio: '2'; expected a number above 1"),
    ("confidence", 1, "confidence: 1; expected a probability in [0.5, 1)"),
    ("confidence", 0.3, "confidence: 0.3; expected a probability in [0.5, 1)"),
    ("confidence", True, "confidence: True; expected a probability"),
    ("confidence", math.nan, "confidence: nan; expected a probability"),
    ("latency_quantiles", (), "latency_quantiles: (); give increasing whole percentiles in 1..99"),
    ("latency_quantiles", (99, 50), "latency_quantiles: (99, 50); give increasing"),
    ("latency_quantiles", (50, 100), "latency_quantiles: (50, 100); give increasing"),
    ("latency_quantiles", (0, 50), "latency_quantiles: (0, 50); give increasing"),
    ("latency_quantiles", (50.5,), "latency_quantiles: (50.5,); give increasing"),
    ("latency_quantiles", (True,), "latency_quantiles: (True,); give increasing"),
    ("latency_quantiles", "99", "latency_quantiles: '99'; give increasing"),
    ("latency_quantiles", [50, 50], "latency_quantiles: (50, 50); give increasing"),
])
def test_bad_thresholds_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ConfigError) as refused:
        StepThresholds(**{field: value}).validate()
    assert message in str(refused.value)


AT = datetime(2026, 12, 5, 18, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "payload, promote, by, timed_out",
    [
        ({"chosen_options": [PROMOTE], "responded_by_user": {"id": "1", "name": "alice"}, "responded_at": AT},
         True, "alice", False),
        ({"chosen_options": [ROLL_BACK], "responded_by_user": {"id": "7", "name": ""}, "responded_at": AT},
         False, "7", False),
        # the timeout: Airflow writes the defaults (Roll back) as the answer, by nobody
        ({"chosen_options": [ROLL_BACK], "responded_by_user": None, "responded_at": AT}, False, None, True),
    ],
)
def test_an_approval_answer_says_what_to_do_and_who_decided(payload, promote, by, timed_out):
    answer = approval_answer(payload)
    assert (answer.promote, answer.by, answer.timed_out) == (promote, by, timed_out)
    assert answer.as_dict()["at"] == "2026-12-05T18:00:00+00:00"


@pytest.mark.parametrize(
    "payload, says",
    [
        (None, "the approval task returned None"),
        ("Promote", "the approval task returned 'Promote'"),
        ({"chosen_options": []}, "chosen_options are []"),
        ({"chosen_options": [PROMOTE, ROLL_BACK]}, "expected one of ['Promote', 'Roll back']"),
        ({"chosen_options": ["promote"]}, "chosen_options are ['promote']"),
        ({"chosen_options": "Promote"}, "chosen_options are 'Promote'"),
        ({}, "chosen_options are None"),
    ],
)
def test_an_approval_answer_that_is_no_answer_is_refused(payload, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        approval_answer(payload)


def test_the_approval_request_shows_every_step_with_its_figures_and_what_each_option_does():
    report = {"model": "propensity", "version": 4, "previous_version": 3, "slo_p99_ms": 50,
              "smoke": {"rows": 16, "max_abs_error": 1e-7, "atol": 1e-5},
              "latency": {"p99_ms": 3.2, "requests": 400},
              "release": {"steps": [
                  {"mode": "shadow", "share": 0, "outcome": "pass",
                   "figures": {"requests": 120, "error_rate": 0.0, "p99_ms": 4.1, "stable_p99_ms": 3.9,
                               "mean_shift": 0.004, "psi": None}},
                  {"mode": "canary", "share": 10, "outcome": "pass",
                   "figures": {"requests": 60, "error_rate": 0.0, "p99_ms": 4.4, "stable_p99_ms": 4.0,
                               "mean_shift": 0.006, "psi": 0.03}}]}}
    asked = approval_request(report, timeout_s=4 * 3600)
    assert asked["subject"] == "Promote propensity version 4? (serving: version 3)"
    body = asked["body"]
    assert "| shadow | pass | 120 | 0.0 | 4.1 (3.9) | 0.004 | - |" in body
    assert "| canary 10% | pass | 60 | 0.0 | 4.4 (4.0) | 0.006 | 0.03 |" in body
    assert "Smoke set: 16 rows" in body and "Latency gate: p99 3.2 ms over 400 requests (SLO 50 ms)" in body
    assert "**Roll back**: every request goes back to version 3" in body and "within 4 h rolls it back" in body
    direct = approval_request({**report, "release": {"steps": []}}, timeout_s=1800)["body"]
    assert "no real traffic: direct release" in direct and "within 0.5 h" in direct


# --- The latency gate before real traffic (judge_gate) -------------------------------------------------------------

GATE = StepThresholds()


@pytest.mark.parametrize(("candidate", "failed", "baseline", "outcome", "reasons"), [
    # alone (nothing served before): only the SLO's one-sided bound and failed requests
    (latencies(380, 1), 0, None, PASS, []),
    (latencies(380, 1, hiccups=(400.0,) * 3), 0, None, PASS, []),  # three slow requests: no evidence
    (latencies(380, 1, median_ms=40), 0, None, FAIL, ["p99 >= "]),  # p99 about 100 ms: over 50 ms
    (latencies(379, 1), 1, None, FAIL, ["1 requests failed"]),
    ([], 5, None, FAIL, ["5 requests failed", "no request was answered"]),
    # beside the serving version, the same load at the same time: a loaded machine weighs on both alike
    (latencies(380, 1, median_ms=40), 0, latencies(380, 2, median_ms=40), HOLD, ["p99 >= "]),
    (latencies(380, 1, median_ms=40), 0, latencies(380, 2, median_ms=10), FAIL, ["p50 ratio", "p99 ratio", "p99 >= "]),
    (latencies(380, 1, median_ms=30), 0, latencies(380, 2, median_ms=10), FAIL, ["p50 ratio", "p99 ratio", "p99 >= "]),
    (latencies(380, 1), 0, latencies(380, 2), PASS, []),
    (latencies(150, 1), 0, latencies(150, 2), PASS, []),  # p99 unbounded from 150: not judged, not failed
])
def test_the_latency_gate_blames_the_version_only_for_what_is_its_own(candidate, failed, baseline, outcome, reasons):
    verdict = judge_gate(candidate, failed, 50, GATE, baseline, 0)
    assert verdict.outcome == outcome, verdict
    assert [r[:len(e)] for r, e in zip(verdict.reasons, reasons, strict=True)] == reasons, verdict.reasons
    assert verdict.checks  # every gate says why in numbers


def test_the_gate_counts_failures_on_both_versions_as_the_machines():
    assert judge_gate(latencies(370, 1), 10, 50, GATE, latencies(370, 2), 10).outcome == HOLD
