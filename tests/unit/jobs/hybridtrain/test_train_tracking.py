"""Rank 0's tracking: the run config's `tracking` section, the step file, and live logging that never stops
training (a server that does not answer is said once, then left alone). The server itself is tested for real in
tests/integration/test_training_tracking.py."""

from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path

import pytest
from hybridflow.utils.mlflow_tracking import read_step_metrics
from hybridjobs.layout import STEP_METRICS_FILE
from hybridtrain.tracking import (
    LiveTracking,
    MlflowRest,
    StepMetricsLog,
    TrackingUnavailable,
    code_version,
    metric_records,
    new_records,
    parse_tracking,
    read_credentials,
)

RUN_ID = "0123456789abcdef0123456789abcdef"


def parsed(value):
    problems: list[str] = []
    return parse_tracking(value, Path("/runs/r"), problems), problems


def test_a_valid_tracking_section_is_read_with_the_credentials_file_beside_the_config():
    config, problems = parsed({"uri": "http://mlflow.example:5000/", "run_id": RUN_ID,
                               "credentials_file": ".mlflow-credentials.json", "flush_every_s": 2})
    assert problems == []
    assert config.uri == "http://mlflow.example:5000" and config.run_id == RUN_ID
    assert config.credentials_file == Path("/runs/r/.mlflow-credentials.json") and config.flush_every_s == 2.0
    assert parsed(None) == (None, [])


@pytest.mark.parametrize("value, field", [
    ("http://x", "tracking:"),
    ({"run_id": RUN_ID}, "tracking.uri"),
    ({"uri": "ftp://x", "run_id": RUN_ID}, "tracking.uri"),
    ({"uri": "file:///tmp/mlruns", "run_id": RUN_ID}, "tracking.uri"),
    ({"uri": "http://user:secret@x:5000", "run_id": RUN_ID}, "tracking.uri"),
    ({"uri": "http://x", "run_id": "abc"}, "tracking.run_id"),
    ({"uri": "http://x", "run_id": RUN_ID.upper()}, "tracking.run_id"),
    ({"uri": "http://x", "run_id": 123}, "tracking.run_id"),
    ({"uri": "http://x", "run_id": RUN_ID, "credentials_file": ""}, "tracking.credentials_file"),
    ({"uri": "http://x", "run_id": RUN_ID, "credentials_file": 7}, "tracking.credentials_file"),
    ({"uri": "http://x", "run_id": RUN_ID, "flush_every_s": 0}, "tracking.flush_every_s"),
    ({"uri": "http://x", "run_id": RUN_ID, "flush_every_s": math.inf}, "tracking.flush_every_s"),
    ({"uri": "http://x", "run_id": RUN_ID, "flush_every_s": True}, "tracking.flush_every_s"),
    ({"uri": "http://x", "run_id": RUN_ID, "password": "x"}, "tracking.password: unknown field"),
])
def test_a_bad_tracking_section_is_refused_naming_the_field(value, field):
    config, problems = parsed(value)
    assert config is None and any(problem.startswith(field) for problem in problems), problems


def test_a_password_in_the_uri_is_refused_without_echoing_it_elsewhere_than_the_field():
    _, problems = parsed({"uri": "http://user:secret@x:5000", "run_id": RUN_ID})
    assert len(problems) == 1 and problems[0].startswith("tracking.uri")


@pytest.mark.parametrize("figures, kept", [
    ({"loss": 0.5, "rows_per_s": 10}, {"loss": 0.5, "rows_per_s": 10.0}),
    ({"loss": math.nan, "auc": math.inf, "flag": True, "text": "x", "none": None}, {}),
])
def test_only_finite_numbers_become_metric_records(figures, kept):
    records = metric_records(7, 1000, figures)
    assert {r["key"]: r["value"] for r in records} == kept
    assert all(r["step"] == 7 and r["timestamp"] == 1000 for r in records)


def test_records_at_or_below_the_highest_logged_step_of_their_metric_are_not_sent_again():
    records = metric_records(10, 1, {"loss": 1.0, "auc": 0.6}) + metric_records(20, 2, {"loss": 0.9})
    fresh = new_records(records, {"loss": 10, "auc": None})
    assert [(r["key"], r["step"]) for r in fresh] == [("auc", 10), ("loss", 20)]


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_step_file_has_a_line_per_record_with_rows_per_second_and_reads_back_the_last_repeat(tmp_path):
    clock = Clock()
    path = tmp_path / STEP_METRICS_FILE
    log = StepMetricsLog(path, rows_per_step=256, clock=clock)
    log.record(10, {"loss": 0.7}, with_rate=True)
    clock.now += 2
    log.record(20, {"loss": 0.6}, with_rate=True)
    log.record(20, {"holdout_auc": 0.71})
    # a resumed job repeats step 20 (from its checkpoint at 10) with another loss; a crash cut a line short
    clock.now += 10
    log.record(20, {"loss": 0.55}, with_rate=True)
    with path.open("a") as file:
        file.write('{"step": 30, "timestamp_ms": 1, "loss"')
    lines = [json.loads(line) for line in path.read_text().splitlines()[:4]]
    assert lines[0] == {"step": 10, "timestamp_ms": 1_000_000, "loss": 0.7}
    assert lines[1]["rows_per_s"] == pytest.approx(10 * 256 / 2)
    assert "rows_per_s" not in lines[3]  # same step: no rate across a resume

    records = read_step_metrics(path.read_text())  # the Airflow side's reader (hybridflow.utils.mlflow_tracking)
    assert [(r["key"], r["step"], r["value"]) for r in records] == [
        ("loss", 10, 0.7), ("holdout_auc", 20, 0.71), ("loss", 20, 0.55), ("rows_per_s", 20, 1280.0)]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_does_not_answer_is_said_once_and_training_goes_on(tmp_path, caplog):
    client = MlflowRest(f"http://127.0.0.1:{closed_port()}", "airflow", "secret-password", timeout_s=2)
    live = LiveTracking(client, RUN_ID, flush_every_s=0.05).start()
    log = StepMetricsLog(tmp_path / STEP_METRICS_FILE, rows_per_step=8, live=live)
    with caplog.at_level(logging.WARNING, "hybridtrain"):
        for step in range(1, 50):
            log.record(step, {"loss": 1.0 / step})
        log.close()
    assert live.failed and "Connection refused" in live.failed
    warnings = [r.getMessage() for r in caplog.records if "MLflow tracking unavailable" in r.getMessage()]
    assert len(warnings) == 1 and RUN_ID in warnings[0] and "secret-password" not in warnings[0]
    assert len((tmp_path / STEP_METRICS_FILE).read_text().splitlines()) == 49  # nothing lost


@pytest.mark.parametrize("content, error", [
    (None, "unreadable"),
    ("not json", "unreadable"),
    ('{"password": "x"}', "no username"),
    ('["airflow"]', "no username"),
])
def test_an_unusable_credentials_file_is_tracking_unavailable_without_its_content(tmp_path, content, error):
    path = tmp_path / "creds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TrackingUnavailable, match=error) as raised:
        read_credentials(path)
    assert '"x"' not in str(raised.value)


def test_credentials_are_read_from_the_file_and_none_without_one(tmp_path):
    path = tmp_path / "creds.json"
    path.write_text('{"username": "airflow", "password": "p"}')
    assert read_credentials(path) == ("airflow", "p") and read_credentials(None) == (None, None)


def test_the_code_version_follows_the_job_code(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    first = code_version(tmp_path)
    assert first == code_version(tmp_path) and len(first) == 16
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert code_version(tmp_path) != first
    assert len(code_version()) == 16  # the real jobs/ tree
