"""The guard's release state and per-request split, by tables: a versioned request always gets its version; shadow
copies unversioned requests to the candidate; canary sends it its share."""

from __future__ import annotations

import random

import pytest
from tritonguard.release import CANARY, KEPT, SHADOW, STABLE, Release, Route, VersionRecorder, route


@pytest.mark.parametrize(("release", "requested", "draw", "expected"), [
    (Release("m", 1), None, 0.0, Route(1)),
    (Release("m", 1), 7, 0.0, Route(7)),  # a version named is the version served, whatever the release
    (Release("m", 1, 2, SHADOW), None, 0.0, Route(1, shadow=2)),
    (Release("m", 1, 2, SHADOW), 2, 0.0, Route(2)),
    (Release("m", 1, 2, CANARY, 10), None, 0.0999, Route(2)),
    (Release("m", 1, 2, CANARY, 10), None, 0.1, Route(1)),
    (Release("m", 1, 2, CANARY, 10), 1, 0.0, Route(1)),
    (Release("m", 1, 2, CANARY, 100), None, 0.9999, Route(2)),
])
def test_each_request_goes_where_the_release_says(release, requested, draw, expected):
    assert route(release, requested, draw) == expected


@pytest.mark.parametrize("share", [1, 10, 50, 90])
def test_the_canary_split_holds_its_share_over_many_requests(share):
    draws = random.Random(share)
    release = Release("m", 1, 2, CANARY, share)
    to_candidate = sum(route(release, None, draws.random()).version == 2 for _ in range(20_000))
    assert abs(to_candidate / 20_000 - share / 100) < 0.01


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "blue-green"}, "mode 'blue-green': choose one of stable, shadow, canary"),
    ({"mode": SHADOW}, "a shadow release needs a candidate other than the stable version 1"),
    ({"mode": CANARY, "candidate": 1, "share": 10}, "a canary release needs a candidate other than"),
    ({"mode": CANARY, "candidate": 2, "share": 0}, "share 0 sends the candidate nothing"),
    ({"mode": CANARY, "candidate": 2, "share": 101}, "share 101: a whole percentage from 0 to 100"),
    ({"mode": CANARY, "candidate": 2, "share": 12.5}, "share 12.5: a whole percentage"),
    ({"mode": CANARY, "candidate": 2, "share": True}, "share True: a whole percentage"),
    ({"mode": STABLE, "share": -1}, "share -1: a whole percentage"),
])
def test_an_impossible_release_is_refused(kwargs, message):
    with pytest.raises(ValueError) as refused:
        Release("m", 1, **kwargs)
    assert message in str(refused.value)


def test_a_recorder_counts_everything_and_keeps_the_newest_figures():
    recorder = VersionRecorder()
    for i in range(KEPT + 10):
        recorder.record(float(i), [i / 10_000], failed=i % 100 == 0)
    recorder.record(1.0, [0.5] * (KEPT * 2))  # one huge batch does not take more than the bound
    snapshot = recorder.snapshot()
    assert snapshot["requests"] == KEPT + 11 and snapshot["errors"] == 51
    assert len(snapshot["latencies_ms"]) == KEPT and snapshot["latencies_ms"][-1] == 1.0
    assert len(snapshot["scores"]) == KEPT and snapshot["scores"][-1] == 0.5
