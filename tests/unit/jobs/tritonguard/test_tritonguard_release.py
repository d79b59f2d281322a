"""The guard's release state and per-request split, by tables: a versioned request always gets its version; shadow
copies unversioned requests to the candidate; canary sends it its share."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tritonguard.metrics import MAX_SERIES, GuardMetrics
from tritonguard.release import (
    CANARY,
    KEPT,
    SHADOW,
    STABLE,
    Release,
    ReleaseBook,
    Route,
    VersionRecorder,
    release_from_request,
    route,
    scores_from_response,
)


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


@pytest.mark.parametrize(("document", "message"), [
    ([1, 2], "the body must be a JSON object"),
    ("canary", "the body must be a JSON object"),
    (None, "the body must be a JSON object"),
    ({}, "stable: None; give a version number"),
    ({"stable": "1"}, "stable: '1'; give a version number"),
    ({"stable": 0}, "stable: 0; give a version number"),
    ({"stable": -3}, "stable: -3; give a version number"),
    ({"stable": True}, "stable: True; give a version number"),
    ({"stable": 2**63}, "stable: 9223372036854775808; give a version number"),
    ({"stable": 1.5}, "stable: 1.5; give a version number"),
    ({"stable": 1, "candidate": "2", "mode": CANARY, "share": 10}, "candidate: '2'; give a version number"),
    ({"stable": 1, "candidate": 2, "mode": "rolling", "share": 10}, "mode 'rolling': choose one of"),
    ({"stable": 1, "candidate": 2, "mode": CANARY, "share": "10"}, "share '10': a whole percentage"),
    ({"stable": 1, "candidate": 2, "mode": CANARY, "share": 1e3}, "share 1000.0: a whole percentage"),
    ({"stable": 1, "candidate": 2, "mode": [CANARY], "share": 10}, "mode ['canary']: choose one of"),
    ({"stable": 1, "weights": {"1": 90}}, "unknown field(s) ['weights']"),
])
def test_a_release_from_the_admin_api_is_checked_field_by_field(document, message):
    with pytest.raises(ValueError) as refused:
        release_from_request("m", document)
    assert message in str(refused.value)


def test_a_release_book_counts_generations_records_only_judged_steps_and_survives_a_restart(tmp_path):
    state = tmp_path / "guard" / "releases.json"
    book = ReleaseBook(state)
    assert book.set(Release("m", 1)) == 1
    book.record("m", 1, 3.0, [0.5], False)
    assert book.figures("m")["stable"]["requests"] == 0  # a stable release has nothing to judge: not recorded
    assert book.set(Release("m", 1, 2, CANARY, 10)) == 2
    book.record("m", 1, 3.0, [0.5], False)
    book.record("m", 2, 9.0, [0.7], True)
    book.record("m", 7, 1.0, [0.1], False)  # a version the release does not name: not its figures
    book.record("other", 2, 1.0, [0.1], False)
    figures = book.figures("m")
    assert figures["generation"] == 2 and figures["release"] == {"stable": 1, "candidate": 2, "mode": CANARY,
                                                                 "share": 10}
    stable, candidate = figures["stable"], figures["candidate"]
    assert (stable["requests"], candidate["requests"], candidate["errors"]) == (1, 1, 1)
    assert figures["candidate"]["scores"] == [0.7] and figures["candidate"]["latencies_ms"] == [9.0]
    assert book.set(Release("m", 1, 2, CANARY, 50)) == 3
    assert book.figures("m")["candidate"]["requests"] == 0  # each step counts from its own generation

    restarted = ReleaseBook(state)
    assert restarted.get("m") == Release("m", 1, 2, CANARY, 50) and restarted.describe("m")["generation"] == 3
    assert restarted.clear("m") is True and restarted.get("m") is None and restarted.figures("m") is None
    assert restarted.clear("m") is False
    assert json.loads(state.read_text()) == {}
    assert not list(state.parent.glob("*.partial"))


def binary_response(values: np.ndarray, datatype: str = "FP32") -> tuple[bytes, str]:
    raw = values.tobytes()
    head = json.dumps({"model_name": "m", "model_version": "2", "outputs": [
        {"name": "OUTPUT__0", "datatype": datatype, "shape": [len(values), 1],
         "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, str(len(head))


@pytest.mark.parametrize(("payload", "header_length", "expected"), [
    (json.dumps({"outputs": [{"name": "o", "datatype": "FP32", "shape": [2, 1], "data": [0.25, 0.5]}]}).encode(),
     None, [0.25, 0.5]),
    (*binary_response(np.array([0.25, 0.75], "<f4")), [0.25, 0.75]),
    (*binary_response(np.array([0.5], "<f8"), "FP64"), [0.5]),
    (*binary_response(np.array([1, 2], "<i4"), "INT32"), []),  # not a score
    (json.dumps({"error": "model not ready"}).encode(), None, []),
    (b"not json", None, []),
    (b"{}", "999", []),
    (b"{}", "x", []),
    (json.dumps({"outputs": [{"datatype": "FP32", "parameters": {"binary_data_size": 400}}]}).encode(), "0", []),
    (json.dumps({"outputs": [{"data": [True, "x", 0.5]}]}).encode(), None, [0.5]),
])
def test_scores_are_read_from_json_and_binary_answers_and_nothing_else(payload, header_length, expected):
    assert scores_from_response(payload, header_length) == expected


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_scores_are_read_from_answers_compressed_as_the_client_asked(encoding):
    import gzip
    import zlib

    payload, header_length = binary_response(np.array([0.25, 0.75], "<f4"))
    packed = gzip.compress(payload) if encoding == "gzip" else zlib.compress(payload)
    assert scores_from_response(packed, header_length, encoding) == [0.25, 0.75]
    assert scores_from_response(b"not compressed", header_length, encoding) == []


def test_metric_labels_stay_bounded_whatever_names_clients_send():
    metrics = GuardMetrics()
    for i in range(MAX_SERIES + 50):
        metrics.observe("m", str(i), "http", 0.001, failed=i % 2 == 0)
    metrics.refused("unknown", "http", "shape")
    text = metrics.exposition().decode()
    assert 'tritonguard_requests_total{model="other",protocol="other",version="other"} 50.0' in text
    series = [line for line in text.splitlines() if line.startswith("tritonguard_requests_total{")]
    assert len(series) == MAX_SERIES + 1  # and "other"
    metrics.released("m", 1, 2, 90)
    metrics.released("m", 1, 3, 50)  # a new candidate: the old one's share is gone, not left at its last value
    text = metrics.exposition().decode()
    assert 'tritonguard_release_share_percent{model="m",role="candidate",version="3"} 50.0' in text
    assert 'version="2"' not in [line for line in text.splitlines() if "release_share" in line and "{" in line][0]
    assert sum("release_share_percent{" in line for line in text.splitlines()) == 2
