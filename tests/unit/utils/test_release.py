"""Judging a release step, by tables: enough traffic, errors, p99, and the score distribution against the stable
version's (mean shift, PSI over its deciles)."""

from __future__ import annotations

import math
import random
import re
from datetime import UTC, datetime

import pytest
from hybridflow.exceptions import ConfigError
from hybridflow.utils.release import (
    FAIL,
    PASS,
    PROMOTE,
    ROLL_BACK,
    WAIT,
    StepThresholds,
    VersionFigures,
    approval_answer,
    approval_request,
    canary_steps,
    decile_edges,
    judge,
    psi,
)

LIMITS = StepThresholds(min_requests=200, max_error_rate=0.01, max_p99_ms=50, max_mean_shift=0.05, max_psi=0.2)


def scores(n: int, mean: float, seed: int, spread: float = 0.1) -> list[float]:
    draw = random.Random(seed)
    return [min(1.0, max(0.0, draw.gauss(mean, spread))) for _ in range(n)]


def figures(n: int = 1000, errors: int = 0, latency_ms: float = 10.0, mean: float = 0.4, seed: int = 1,
            tail_ms: float | None = None, extra: list[float] | None = None) -> VersionFigures:
    latencies = [latency_ms] * n
    if tail_ms is not None:  # the slowest 2% of requests
        latencies[: n // 50] = [tail_ms] * (n // 50)
    return VersionFigures(requests=n, errors=errors, latencies_ms=latencies,
                          scores=scores(n, mean, seed) + (extra or []))


STABLE = figures(seed=1)


@pytest.mark.parametrize(("candidate", "outcome", "reasons"), [
    (figures(seed=2), PASS, []),  # the same model on other requests: same distribution
    (figures(n=150, seed=2), WAIT, ["150 of 200 requests needed on each version so far"]),
    (figures(errors=30, seed=2), FAIL, ["error rate 3.00% > 1.00%"]),
    (figures(errors=10, seed=2), PASS, []),  # 1.00% is within 1%
    (figures(tail_ms=400, seed=2), FAIL, ["p99 400.0 ms > 50 ms"]),
    (figures(tail_ms=45, seed=2), PASS, []),
    (figures(mean=0.55, seed=2), FAIL, ["mean score shift", "PSI"]),
    (figures(mean=0.42, seed=2), PASS, []),  # a small shift within both limits
    (figures(seed=2, extra=[math.nan] * 3), FAIL, ["3 non-finite scores"]),
    (VersionFigures(1000, 0, [10.0] * 1000, []), FAIL, ["no score to compare"]),
    (VersionFigures(1000, 1000, [], []), FAIL, ["error rate 100.00%", "p99 nan ms", "no score"]),  # none answered
    (figures(errors=500, tail_ms=900, mean=0.9, seed=3), FAIL, ["error rate", "p99", "mean score shift", "PSI"]),
])
def test_a_step_passes_waits_or_fails_naming_the_figure_and_its_threshold(candidate, outcome, reasons):
    verdict = judge(STABLE, candidate, LIMITS)
    assert verdict.outcome == outcome, verdict
    assert len(verdict.reasons) == len(reasons), verdict.reasons
    for reason, expected in zip(verdict.reasons, reasons, strict=True):
        assert reason.startswith(expected), verdict.reasons


def test_a_stable_version_without_traffic_keeps_the_step_waiting():
    verdict = judge(figures(n=10), figures(seed=2), LIMITS)
    assert verdict.outcome == WAIT and verdict.figures == {"requests": 1000, "stable_requests": 10}


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
    assert verdict.outcome == FAIL and verdict.reasons == ("mean score shift 0.1000 > 0.05",)


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
