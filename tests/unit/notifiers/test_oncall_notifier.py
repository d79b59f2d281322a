"""The on-call notifier (hybridflow.notifiers.oncall): alert content, stage -> runbook, dedup, scrubbing,
and a real delivery to a webhook on loopback.

The Airflow callback context is built by hand: ``FakeTaskInstance`` is a double at the Airflow context
boundary (a real RuntimeTaskInstance needs the task runner's supervisor to read XComs). Everything behind it
is real: the notifier is called through Airflow's own ``BaseNotifier.__call__``, the alerts file and the
dedup state are real files with real locks, and the webhook is a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hybridflow.exceptions import SlurmJobFailed
from hybridflow.notifiers.oncall import (
    GENERAL_RUNBOOK,
    RUNBOOKS,
    OnCallNotifier,
    alert_from_context,
    build_alert,
    record_sent,
    runbook_for,
    scrub,
    should_send,
    stage_of,
)

REPO = Path(__file__).resolve().parents[3]
NOW = datetime(2026, 12, 2, 3, 15, tzinfo=UTC)
SLURM_ERROR = SlurmJobFailed(
    "Slurm job 4711 (hf-nightly-training-train-abc) ended FAILED with exit code 1:0 after 93 s. \n"
    "Last lines of /storage/runs/nightly/logs/hf-4711.err:\n"
    "step 100 loss 0.52\nTraceback (most recent call last):\nRuntimeError: CUDA out of memory\n"
    "Runbook: include/runbooks/training.md"
)


class FakeTaskInstance:
    def __init__(self, task_id: str, xcoms: dict | None = None, try_number: int = 3,
                 dag_id: str = "nightly_training", run_id: str = "scheduled__2026-12-01T00:00:00+00:00",
                 broken_xcom: bool = False):
        self.task_id, self.dag_id, self.run_id, self.try_number = task_id, dag_id, run_id, try_number
        self.map_index = -1
        self.xcoms = xcoms or {}
        self.broken_xcom = broken_xcom

    def xcom_pull(self, task_ids: str, key: str):
        if self.broken_xcom:
            raise ConnectionError("api server unreachable")
        assert task_ids == self.task_id
        return self.xcoms.get(key)


def context_for(task_id: str = "training.train", exception=SLURM_ERROR, **ti_kwargs) -> dict:
    ti = FakeTaskInstance(task_id, **ti_kwargs)
    return {"ti": ti, "task_instance": ti, "run_id": ti.run_id, "exception": exception}


def test_notifier_alert_names_dag_run_stage_job_log_tail_and_runbook():
    alert = alert_from_context(context_for(xcoms={"slurm_job_id": "4711"}), now=NOW)
    assert (alert.dag_id, alert.run_id, alert.stage, alert.task_id, alert.try_number, alert.job_id) == (
        "nightly_training", "scheduled__2026-12-01T00:00:00+00:00", "training", "training.train", 3, "4711")
    assert alert.runbook == "include/runbooks/training.md"
    assert alert.error.startswith(
        "SlurmJobFailed: Slurm job 4711 (hf-nightly-training-train-abc) ended FAILED")
    assert alert.log_tail.splitlines() == ["step 100 loss 0.52", "Traceback (most recent call last):",
                                           "RuntimeError: CUDA out of memory"]
    text = alert.text()
    for fragment in ("FAILED nightly_training / stage training (task training.train, try 3)",
                     "run: scheduled__2026-12-01T00:00:00+00:00", "remote job: 4711",
                     "runbook: include/runbooks/training.md", "RuntimeError: CUDA out of memory"):
        assert fragment in text
    assert alert.to_json()["at"] == NOW.isoformat()


@pytest.mark.parametrize(
    "xcoms, exception, job_id, tail",
    [
        ({"job_id": 99}, ValueError("bad\nline two"), "99", "ValueError: bad\nline two"),
        ({"slurm_job_id": "7", "job_id": "8"}, ValueError("x"), "7", "ValueError: x"),
        ({}, SLURM_ERROR, "4711", "RuntimeError: CUDA out of memory"),
        ({"log_tail": "remote line 1\nremote line 2"}, SLURM_ERROR, "4711", "remote line 1\nremote line 2"),
        ({}, RuntimeError("spark-submit exited 1"), None, "RuntimeError: spark-submit exited 1"),
    ],
    ids=["job_id-key", "slurm-key-first", "job-from-error", "log_tail-xcom", "no-remote-job"],
)
def test_notifier_job_id_and_log_tail_sources(xcoms, exception, job_id, tail):
    alert = alert_from_context(context_for(xcoms=xcoms, exception=exception), now=NOW)
    assert alert.job_id == job_id
    assert alert.log_tail.endswith(tail)


def test_notifier_log_tail_keeps_the_last_lines_only():
    error = RuntimeError("\n".join(f"line {n}" for n in range(100)))
    alert = alert_from_context(context_for(exception=error), log_lines=5, now=NOW)
    assert alert.log_tail.splitlines() == ["line 95", "line 96", "line 97", "line 98", "line 99"]


def test_notifier_alert_goes_out_when_xcoms_cannot_be_read():
    alert = alert_from_context(context_for(broken_xcom=True), now=NOW)
    assert alert.job_id == "4711" and alert.stage == "training"


def test_notifier_dag_level_context_uses_the_reason():
    class Dag:
        dag_id = "workload_router"

    context = {"dag": Dag(), "run_id": "manual__1", "reason": "task_failure"}
    alert = alert_from_context(context, default_stage="router", now=NOW)
    assert (alert.stage, alert.task_id) == ("router", None)
    assert alert.runbook == "include/runbooks/workload-router.md"
    assert alert.error == "task_failure" and "the DAG run" in alert.text()


@pytest.mark.parametrize(
    "task_id, dag_id, default_stage, stage, runbook",
    [
        ("features.build_features", "nightly_training", None, "features", "include/runbooks/features.md"),
        ("quality.gate", "nightly_training", None, "quality", "include/runbooks/data-quality.md"),
        ("capacity", "nightly_training", None, "capacity", "include/runbooks/capacity.md"),
        ("checkpoint.wait", "nightly_training", None, "checkpoint", "include/runbooks/training.md"),
        ("export.publish", "nightly_training", None, "export", "include/runbooks/evaluation.md"),
        ("deploy.latency_gate", "nightly_training", None, "deploy", "include/runbooks/deploy.md"),
        ("report.write", "nightly_training", None, "report", "include/runbooks/report.md"),
        ("allreduce_benchmark", "cluster_preflight", None, "cluster_preflight",
         "include/runbooks/preflight.md"),
        ("slurm_partition", "platform_healthcheck", None, "platform_healthcheck",
         "include/runbooks/platform-healthcheck.md"),
        ("rollback", "oncall_rollback", "oncall", "oncall", "include/runbooks/oncall.md"),
        ("scoring.score", "backfill", "backfill", "scoring", "include/runbooks/scoring.md"),
        ("validate_spec", "workload_router", "router", "router", "include/runbooks/workload-router.md"),
        ("mystery.step", "nightly_training", None, "mystery", GENERAL_RUNBOOK),
        (None, "some_dag", None, "some_dag", GENERAL_RUNBOOK),
    ],
)
def test_notifier_stage_and_runbook(task_id, dag_id, default_stage, stage, runbook):
    assert stage_of(task_id, dag_id, default_stage) == stage
    assert runbook_for(stage) == runbook


REQUIRED_HEADINGS = ("symptoms", "checks", "fixes", "rerun safely")


@pytest.mark.parametrize("runbook", sorted({*RUNBOOKS.values(), GENERAL_RUNBOOK}))
def test_notifier_every_runbook_exists_with_symptoms_checks_fixes_and_rerun(runbook):
    path = REPO / runbook
    assert path.is_file(), f"{runbook} is missing"
    headings = [line[3:].lower() for line in path.read_text().splitlines() if line.startswith("## ")]
    missing = [name for name in REQUIRED_HEADINGS if not any(name in heading for heading in headings)]
    assert not missing, f"{runbook} has no '## ' heading for {missing}; headings: {headings}"


def test_notifier_every_pipeline_stage_has_a_runbook():
    stages = ["preflight", "features", "quality", "capacity", "training", "checkpoint", "evaluation",
              "export", "scoring", "deploy", "report", "backfill", "router", "oncall", "platform_healthcheck",
              "cluster_preflight"]
    assert [stage for stage in stages if stage not in RUNBOOKS] == []


@pytest.mark.parametrize(
    "sent_at, now, window, expected",
    [
        ({}, 1000.0, 3600, True),
        ({"d:training": 1000.0}, 1000.0 + 3599, 3600, False),
        ({"d:training": 1000.0}, 1000.0 + 3600, 3600, True),
        ({"d:features": 1000.0}, 1001.0, 3600, True),
        ({"d:training": 1000.0}, 1001.0, 0, True),
    ],
    ids=["first", "within-window", "window-over", "other-stage", "no-window"],
)
def test_notifier_dedup_window(sent_at, now, window, expected):
    assert should_send(sent_at, "d:training", now, window) is expected


def test_notifier_dedup_state_drops_old_entries():
    assert record_sent({"a": 0.0, "b": 5000.0}, "c", 6000.0, 3600) == {"b": 5000.0, "c": 6000.0}


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def logged(capsys, caplog) -> str:
    """What the notifier logged: Airflow's structlog setup writes to stdout, the stdlib one to caplog."""
    return capsys.readouterr().out + caplog.text


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_notifier_repeated_failures_of_a_stage_are_sent_once_per_window(tmp_path, capsys, caplog):
    clock = FakeClock(1_000_000.0)
    alerts = tmp_path / "alerts" / "alerts.jsonl"
    notifier = OnCallNotifier(dedup_window_s=3600, alerts_file=str(alerts), clock=clock)
    notifier(context_for())
    clock.now += 600
    notifier(context_for(try_number=4))
    assert [line["try_number"] for line in read_lines(alerts)] == [3]
    assert "On-call alert suppressed (stage training of nightly_training" in logged(capsys, caplog)
    notifier(context_for(task_id="scoring.score", exception=RuntimeError("spark-submit exited 1")))
    clock.now += 3600
    notifier(context_for(try_number=5))
    assert [(line["stage"], line["try_number"]) for line in read_lines(alerts)] == [
        ("training", 3), ("scoring", 3), ("training", 5)]
    state = json.loads((alerts.parent / "oncall-dedup.json").read_text())
    assert state == {"nightly_training:training:scheduled__2026-12-01T00:00:00+00:00": clock.now}, (
        "entries older than the window are dropped")


RUN_1 = "scheduled__2026-12-01T00:00:00+00:00"
RUN_2 = "manual__2026-12-01T02:30:00+00:00"


@pytest.mark.parametrize(
    "failures, alerted",
    [
        ([("training.train", RUN_1, 3), ("training.train", RUN_1, 4)], [("training", RUN_1, 3)]),
        ([("training.train", RUN_1, 3), ("training.train", RUN_2, 1)],
         [("training", RUN_1, 3), ("training", RUN_2, 1)]),
        ([("training.train", RUN_1, 3), ("scoring.score", RUN_1, 3)],
         [("training", RUN_1, 3), ("scoring", RUN_1, 3)]),
        ([("training.train", RUN_1, 3), ("training.train", RUN_2, 1), ("training.train", RUN_1, 4),
          ("training.train", RUN_2, 2)], [("training", RUN_1, 3), ("training", RUN_2, 1)]),
    ],
    ids=["same-run-twice-one-alert", "two-runs-same-stage-two-alerts", "other-stage-two-alerts",
         "two-runs-each-retried-one-alert-each"],
)
def test_notifier_dedup_is_per_dag_run_and_stage(tmp_path, failures, alerted):
    """Within one dedup window: a run's repeated failure of a stage alerts once, while another run of the
    same DAG failing in the same stage, or the same run failing in another stage, alerts on its own."""
    clock = FakeClock(1_000_000.0)
    alerts = tmp_path / "alerts.jsonl"
    notifier = OnCallNotifier(dedup_window_s=3600, alerts_file=str(alerts), clock=clock)
    for task_id, run_id, try_number in failures:
        notifier(context_for(task_id=task_id, run_id=run_id, try_number=try_number))
        clock.now += 60
    assert [(line["stage"], line["run_id"], line["try_number"]) for line in read_lines(alerts)] == alerted


def test_notifier_default_alerts_file_is_under_the_storage_root(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_ALERTS_FILE", raising=False)
    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", str(tmp_path))
    OnCallNotifier()(context_for())
    assert read_lines(tmp_path / "alerts" / "alerts.jsonl")[0]["job_id"] == "4711"


PRIVATE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
               "-----END OPENSSH PRIVATE KEY-----")


@pytest.mark.parametrize(
    "text, secret, kept",
    [
        (f"loaded key\n{PRIVATE_KEY}\ndone", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ",
         "[REDACTED PRIVATE KEY]"),
        ("tail cut: -----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA", "MIIEowIBAAKCAQEA", "tail cut:"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig", "eyJhbGciOiJIUzI1NiJ9", "Authorization:"),
        ("curl -H 'Bearer abcdefgh12345678' host", "abcdefgh12345678", "curl -H"),
        ("connecting with password=hunter2secret user=mlops", "hunter2secret", "user=mlops"),
        ('{"db_password": "s3cr3t-value", "host": "db"}', "s3cr3t-value", '"host": "db"'),
        ("api_key: 0123456789abcdef", "0123456789abcdef", "api_key:"),
        ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI",
         "aws_secret_access_key"),
        ("key id AKIAIOSFODNN7EXAMPLE in use", "AKIAIOSFODNN7EXAMPLE", "key id"),
        ("leaked wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY here", "wJalrXUtnFEMI", "leaked"),
        ("s3://minio:minio-secret-1@127.0.0.1:9000/bucket", "minio-secret-1", "127.0.0.1:9000/bucket"),
        ("POST https://hooks.slack.com/services/T000/B000/XXXXXXXX failed", "T000/B000", "failed"),
        ("MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKjMzEfYyjiWA4R4\nEND",
         "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKjMzEfYyjiWA4R4", "END"),
    ],
)
def test_notifier_scrubs_secrets(text, secret, kept):
    cleaned = scrub(text)
    assert secret not in cleaned
    assert kept in cleaned


@pytest.mark.parametrize(
    "text",
    [
        "checkpoint sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 verified",
        "sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709 ok",
        "Slurm job 4711 ended FAILED with exit code 1:0 after 93 s",
        "step 100 loss 0.52 lr 1e-3",
    ],
)
def test_notifier_scrubber_keeps_ordinary_text(text):
    assert scrub(text) == text


def test_notifier_alert_is_scrubbed_before_it_leaves():
    error = RuntimeError(f"ssh failed\n{PRIVATE_KEY}\npassword=hunter2secret")
    alert = build_alert(dag_id="d", run_id="r", task_id="training.train", try_number=1, error=error, now=NOW)
    dumped = json.dumps(alert.to_json())
    assert "hunter2secret" not in dumped and "b3BlbnNzaC1rZXkt" not in dumped


def test_notifier_key_block_above_the_tail_is_still_scrubbed():
    key_lines = "\n".join(f"QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo{n:02d}abcdefghijklmnop" for n in range(10))
    remote_log = f"-----BEGIN RSA PRIVATE KEY-----\n{key_lines}\n-----END RSA PRIVATE KEY-----\nexit 1"
    alert = build_alert(dag_id="d", run_id="r", task_id="training.train", try_number=1, error="failed",
                        remote_log_tail=remote_log, log_lines=3, now=NOW)
    assert "QUJDREVG" not in alert.log_tail and alert.log_tail.endswith("exit 1")


class WebhookRecorder(BaseHTTPRequestHandler):
    requests: list[dict] = []
    status = 200

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests.append({"path": self.path, "headers": dict(self.headers),
                                    "body": json.loads(body)})
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    handler = type("Recorder", (WebhookRecorder,), {"requests": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def webhook_connection(monkeypatch, port: int, **extra) -> None:
    conn = {"conn_type": "http", "host": "127.0.0.1", "port": port, "schema": "http",
            "password": "oncall-token-42", "extra": {"endpoint": "/hooks/oncall", **extra}}
    monkeypatch.setenv("AIRFLOW_CONN_ONCALL_WEBHOOK", json.dumps(conn))


def test_notifier_posts_the_alert_to_a_webhook(tmp_path, monkeypatch, capsys, caplog, webhook):
    recorder, port = webhook
    webhook_connection(monkeypatch, port)
    notifier = OnCallNotifier(sink_conn_id="oncall_webhook", alerts_file=str(tmp_path / "alerts.jsonl"))
    notifier(context_for(xcoms={"slurm_job_id": "4711"}))
    assert len(recorder.requests) == 1
    request = recorder.requests[0]
    assert request["path"] == "/hooks/oncall"
    assert request["headers"]["Authorization"] == "Bearer oncall-token-42"
    assert request["headers"]["Content-Type"] == "application/json"
    body = request["body"]
    assert (body["dag_id"], body["stage"], body["job_id"], body["runbook"]) == (
        "nightly_training", "training", "4711", "include/runbooks/training.md")
    assert "RuntimeError: CUDA out of memory" in body["text"]
    assert read_lines(tmp_path / "alerts.jsonl")[0]["job_id"] == "4711"
    log = logged(capsys, caplog)
    assert "sent to the webhook of connection oncall_webhook (HTTP 200)" in log
    assert "oncall-token-42" not in log


def test_notifier_slack_payload_is_text_only(tmp_path, monkeypatch, webhook):
    recorder, port = webhook
    webhook_connection(monkeypatch, port, payload="slack")
    OnCallNotifier(sink_conn_id="oncall_webhook", alerts_file=str(tmp_path / "alerts.jsonl"))(context_for())
    assert list(recorder.requests[0]["body"]) == ["text"]
    text = recorder.requests[0]["body"]["text"]
    assert text.startswith("[hybridflow] FAILED nightly_training / stage training")


def test_notifier_failed_delivery_raises_and_is_retried_next_time(tmp_path, monkeypatch, webhook):
    recorder, port = webhook
    recorder.status = 500
    webhook_connection(monkeypatch, port)
    notifier = OnCallNotifier(sink_conn_id="oncall_webhook", alerts_file=str(tmp_path / "alerts.jsonl"))
    refused = re.escape("webhook of connection 'oncall_webhook' answered HTTP 500")
    with pytest.raises(RuntimeError, match=refused):
        notifier(context_for())
    recorder.status = 200
    notifier(context_for())
    assert len(recorder.requests) == 2, "a failed delivery does not count for the dedup window"
    assert len(read_lines(tmp_path / "alerts.jsonl")) == 2


# --- alerts of kind "action": a task that did something on-call must know of ---------------------------------

RECONCILER_RUN = "scheduled__2026-12-02T03:15:00+00:00"


def action_alert(**changes):
    fields = dict(dag_id="slurm_reconciler", run_id=RECONCILER_RUN, task_id="reconcile", try_number=1,
                  error="cancelled 1 orphaned Slurm job(s) of the suite", job_id="512",
                  remote_log_tail="slurm job 512 name=hf-x ... decision=cancel: ... -> CANCELLED (per scontrol)",
                  kind="action", now=NOW)
    return build_alert(**(fields | changes))


def test_notifier_action_alert_says_what_was_done_not_failed():
    alert = action_alert()
    text = alert.text()
    assert text.startswith("[hybridflow] ACTION slurm_reconciler / stage slurm_reconciler (task reconcile, try 1)")
    for fragment in ("remote job: 512", "what: cancelled 1 orphaned Slurm job(s)",
                     "runbook: include/runbooks/slurm-reconciler.md", "details:\nslurm job 512 name=hf-x"):
        assert fragment in text
    assert "FAILED" not in text and "error:" not in text
    assert (alert.to_json()["kind"], alert.dedup_key) == ("action", f"action:slurm_reconciler:slurm_reconciler:"
                                                                    f"{RECONCILER_RUN}")
    assert build_alert(dag_id="d", run_id="r", task_id="t", try_number=1, error="x").kind == "failure"


def test_notifier_alert_kind_must_be_known():
    with pytest.raises(ValueError, match="alert kind 'notice' is not one of failure, action"):
        action_alert(kind="notice")


def test_notifier_send_delivers_an_action_once_and_a_later_failure_of_the_run_still_alerts(tmp_path):
    clock = FakeClock(1_000_000.0)
    alerts = tmp_path / "alerts.jsonl"
    notifier = OnCallNotifier(dedup_window_s=3600, alerts_file=str(alerts), clock=clock)
    notifier.send(action_alert())
    notifier.send(action_alert())  # the same run's retry: suppressed
    notifier(context_for(task_id="reconcile", dag_id="slurm_reconciler", run_id=RECONCILER_RUN, try_number=1,
                         exception=SlurmJobFailed("scancel did not end Slurm job 513 within 30 s")))
    assert [(line["kind"], line["job_id"]) for line in read_lines(alerts)] == [("action", "512"),
                                                                               ("failure", "513")]
