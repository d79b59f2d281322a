"""The all-reduce share of a training step: which steps are measured, and the summary metrics.json reports."""

from __future__ import annotations

import pytest
from hybridtrain.allreduce import METHOD, is_sample_step, summarise_allreduce


@pytest.mark.parametrize(
    ("every", "steps", "measured"),
    [
        (25, range(0, 100), [24, 49, 74, 99]),
        (1, range(0, 4), [0, 1, 2, 3]),
        (5, range(40, 52), [44, 49]),
        (100, range(0, 60), []),
    ],
    ids=["default-period", "every-step", "resumed-at-step-40", "run-shorter-than-period"],
)
def test_training_allreduce_sample_steps_depend_on_the_step_number_only(every, steps, measured):
    """Every rank evaluates the same rule on the same step numbers, so their collectives match."""
    assert [step for step in steps if is_sample_step(step, every)] == measured


@pytest.mark.parametrize(
    ("samples", "world_size", "expected"),
    [
        (
            [[25, 10.0, 2.0], [50, 12.0, 3.0], [75, 11.0, 2.5]],
            2,
            {"share": 0.2273, "comm_ms_median": 2.5, "step_ms_median": 11.0, "samples": 3},
        ),
        (
            [[25, 8.0, 1.0], [50, 10.0, 5.0], [75, 100.0, 2.0], [100, 9.0, 3.0]],
            8,
            {"share": 0.2632, "comm_ms_median": 2.5, "step_ms_median": 9.5, "samples": 4},
        ),
        (
            [[25, 4.0, None], [50, 6.0, None]],
            1,
            {
                "share": None,
                "comm_ms_median": None,
                "step_ms_median": 5.0,
                "samples": 2,
                "reason": "one rank: no gradient all-reduce",
            },
        ),
        (
            [],
            1,
            {
                "share": None,
                "comm_ms_median": None,
                "step_ms_median": None,
                "samples": 0,
                "reason": "one rank: no gradient all-reduce",
            },
        ),
        (
            [],
            4,
            {
                "share": None,
                "comm_ms_median": None,
                "step_ms_median": None,
                "samples": 0,
                "reason": "no step was measured: the run took fewer than allreduce_sample_every_steps=25 steps",
            },
        ),
    ],
    ids=["two-ranks", "median-ignores-an-outlier-step", "one-rank-is-null-not-zero", "one-rank-no-samples", "none"],
)
def test_training_allreduce_summary(samples, world_size, expected):
    summary = summarise_allreduce(samples, every_steps=25, world_size=world_size, elements=129)
    assert {key: summary.get(key) for key in expected} == expected
    assert "reason" in summary or summary["share"] is not None, "a null share always says why"
    assert (summary["every_steps"], summary["world_size"], summary["elements"]) == (25, world_size, 129)
    assert summary["series"] == samples
    assert summary["method"] == METHOD.format(every=25, elements=129)
    assert "129 elements" in summary["method"] and "every 25 optimizer steps" in summary["method"]
