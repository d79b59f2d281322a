"""The on-call failure notifier every DAG of the suite uses, and the pure parts of its alerts.

An alert names the DAG, run, stage, task, try, the remote job id, the error, the last lines of the remote
job's log and the runbook of the stage in ``include/runbooks/``. Secrets are scrubbed from every text field
before the alert leaves the process. Delivery: one JSON line appended to the local alerts file (always: it is
the record), and a POST to a webhook when a connection is configured (an ``http`` connection: any JSON
webhook, or a Slack incoming webhook with ``extra.payload = "slack"``). A stage of a DAG run that already
alerted within the dedup window is not sent again (its retries fail the same way); the same stage failing in
another run of the DAG is a new alert. The suppression is logged.

Use it as a task callback (``default_args={"on_failure_callback": OnCallNotifier()}``) so the alert carries
the stage, the exception and the task's XComs; as a DAG callback it falls back to the run's last task and its
reason. A task that did something on-call must know of (the orphan reconciler cancelling jobs) sends an alert of
kind ``action`` through the same sinks with :meth:`OnCallNotifier.send`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from airflow.sdk import BaseNotifier

from hybridflow.layout import StorageLayout

DEFAULT_STORAGE_ROOT = "/var/lib/hybridflow/storage"
ALERTS_FILE_ENV = "HYBRIDFLOW_ALERTS_FILE"
DEDUP_STATE_NAME = "oncall-dedup.json"
GENERAL_RUNBOOK = "include/runbooks/general.md"
JOB_ID_XCOM_KEYS = ("slurm_job_id", "job_id")
LOG_TAIL_XCOM_KEY = "log_tail"
MAX_LINE_CHARS = 500
MAX_ERROR_CHARS = 1000
WEBHOOK_TIMEOUT_S = 10.0

RUNBOOKS: dict[str, str] = {
    "preflight": "include/runbooks/preflight.md",
    "cluster_preflight": "include/runbooks/preflight.md",
    "features": "include/runbooks/features.md",
    "quality": "include/runbooks/data-quality.md",
    "capacity": "include/runbooks/capacity.md",
    "training": "include/runbooks/training.md",
    "checkpoint": "include/runbooks/training.md",
    "evaluation": "include/runbooks/evaluation.md",
    "export": "include/runbooks/evaluation.md",
    "scoring": "include/runbooks/scoring.md",
    "deploy": "include/runbooks/deploy.md",
    "report": "include/runbooks/report.md",
    "backfill": "include/runbooks/backfill.md",
    "router": "include/runbooks/workload-router.md",
    "workload_router": "include/runbooks/workload-router.md",
    "oncall": "include/runbooks/oncall.md",
    "oncall_rollback_model": "include/runbooks/oncall.md",
    "oncall_training_job": "include/runbooks/oncall.md",
    "platform_healthcheck": "include/runbooks/platform-healthcheck.md",
    "slurm_reconciler": "include/runbooks/slurm-reconciler.md",
    "cluster_utilization": "include/runbooks/utilization.md",
}
FAILURE, ACTION, LATE, STALL, UNHEALTHY_NODE = "failure", "action", "late", "stall", "unhealthy_node"
LOW_UTILIZATION = "low_utilization"  # a GPU partition under its utilization target for days (cluster_utilization)
RELEASE_HELD = "release_held"  # a release step where both versions broke the SLO: the machine, not the candidate
ALERT_KINDS = (FAILURE, ACTION, LATE, STALL, UNHEALTHY_NODE, LOW_UTILIZATION, RELEASE_HELD)

REDACTED = "[REDACTED]"
_SECRET_KEY_NAME = (r"[\w.-]*?(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
                    r"[\w.-]*")
SCRUB_RULES: tuple[tuple[re.Pattern, str], ...] = (
    # A PEM private key block, also one cut off by the end of a log tail.
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S),
     "[REDACTED PRIVATE KEY]"),
    (re.compile(r"(?i)(\bauthorization[\"']?\s*[=:]\s*)[^\n]+"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{8,}"), rf"\1\2{REDACTED}"),
    (re.compile(r"(?i)(https?://hooks\.slack\.com/)\S+"), rf"\1{REDACTED}"),
    # Credentials in a URL: scheme://user:password@host.
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/@]+:)[^\s@/]+@"), rf"\1{REDACTED}@"),
    # key=value, key: value, "key": "value" for names that say secret.
    (re.compile(rf"(?i)([\"']?\b{_SECRET_KEY_NAME}[\"']?\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&}}\]]+)"),
     rf"\1{REDACTED}"),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), REDACTED),
    # A line of base64 only, as in the body of a key whose BEGIN line was cut off above a log tail.
    (re.compile(r"^[A-Za-z0-9+/=]{60,}$", re.M), REDACTED),
    # An AWS secret access key: 40 base64 characters with upper, lower case and digits (a sha1 hex has no
    # upper case, so checksums survive).
    (re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]{0,39}[A-Z])(?=[A-Za-z0-9/+=]{0,39}[a-z])"
                r"(?=[A-Za-z0-9/+=]{0,39}[0-9])[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])"), REDACTED),
)
_LOG_TAIL_IN_ERROR = re.compile(r"Last lines of [^\n]*:\n(?P<tail>.*?)(?:\nRunbook: [^\n]*)?\s*\Z", re.S)
_SLURM_JOB_IN_ERROR = re.compile(r"\bSlurm job (?P<id>\d+(?:_\d+)?)\b")


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def scrub(text: str) -> str:
    """``text`` with private key blocks, bearer/basic tokens, ``password=...``-like values, credentials in
    URLs, Slack webhook paths and AWS keys replaced by ``[REDACTED]``."""
    for pattern, replacement in SCRUB_RULES:
        text = pattern.sub(replacement, text)
    return text


def stage_of(task_id: str | None, dag_id: str | None = None, default_stage: str | None = None) -> str:
    """
    The pipeline stage a failed task belongs to: its task group (the part of the task id before the first
    dot) or its own id when either is a known stage, else ``default_stage``, else the DAG's id when that is a
    stage (``cluster_preflight``, ``platform_healthcheck``), else the group or task id itself.
    """
    group = task_id.split(".", 1)[0] if task_id else None
    for candidate in (group, task_id, default_stage, dag_id):
        if candidate in RUNBOOKS:
            return candidate
    return default_stage or group or dag_id or "unknown"


def runbook_for(stage: str) -> str:
    """The stage's runbook, relative to the repository root; the general runbook for a stage without one."""
    return RUNBOOKS.get(stage, GENERAL_RUNBOOK)


def log_tail(text: str | None, max_lines: int) -> str:
    """The last ``max_lines`` lines of ``text``, each cut to a readable length."""
    if not text:
        return ""
    lines = text.rstrip("\n").splitlines()[-max_lines:]
    return "\n".join(_truncate(line, MAX_LINE_CHARS) for line in lines)


def tail_from_error(error_text: str) -> str | None:
    """The remote log tail an operator put in its error ("Last lines of <log>:" ... "Runbook: ...")."""
    match = _LOG_TAIL_IN_ERROR.search(error_text)
    return match.group("tail") if match else None


def job_id_from_error(error_text: str) -> str | None:
    match = _SLURM_JOB_IN_ERROR.search(error_text)
    return match.group("id") if match else None


@dataclass(frozen=True)
class Alert:
    dag_id: str
    run_id: str
    stage: str
    task_id: str | None
    try_number: int | None
    job_id: str | None
    error: str
    log_tail: str
    runbook: str
    at: str
    log_url: str | None = None
    kind: str = FAILURE

    @property
    def dedup_key(self) -> str:
        """One alert per stage of a DAG run: ``<dag>:<stage>:<run>`` (the run id last: it may hold colons, a
        DAG id or a stage cannot); an action is keyed apart (``action:<dag>:<stage>:<run>``), so a failure of the
        same run after it still alerts."""
        key = f"{self.dag_id}:{self.stage}:{self.run_id}"
        return key if self.kind == FAILURE else f"{self.kind}:{key}"

    def text(self) -> str:
        """The human-readable message: what failed (or was done), where, the remote job, the runbook, the log
        tail (an action's details)."""
        task = f"task {self.task_id}" if self.task_id else "the DAG run"
        failure = self.kind == FAILURE
        lines = [
            f"[hybridflow] {'FAILED' if failure else self.kind.upper()} {self.dag_id} / stage {self.stage} ({task}, "
            f"try {self.try_number or '?'})",
            f"run: {self.run_id}",
            f"remote job: {self.job_id or 'none'}",
            f"{'error' if failure else 'what'}: {self.error}",
            f"runbook: {self.runbook}",
        ]
        if self.log_url:
            lines.append(f"log: {self.log_url}")
        tail_title = "last log lines" if failure else "details"
        lines.append(f"{tail_title}:" if self.log_tail else f"{tail_title}: (none)")
        if self.log_tail:
            lines.append(self.log_tail)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text()}


def build_alert(*, dag_id: str, run_id: str, task_id: str | None, try_number: int | None, error: Any,
                job_id: Any = None, remote_log_tail: str | None = None, default_stage: str | None = None,
                log_lines: int = 40, log_url: str | None = None, now: datetime | None = None,
                kind: str = FAILURE) -> Alert:
    """
    The alert of a failure, every text field scrubbed of secrets (whole texts are scrubbed before they are
    cut, so a key block that starts above the tail is still recognized). The log tail is the remote job's
    (``remote_log_tail``, or the one the operator put in its error), else the error's own last lines; the job
    id is the one given, else the Slurm job the error names. ``kind="action"``: ``error`` says what a task did
    and ``remote_log_tail`` holds its details.
    """
    if kind not in ALERT_KINDS:
        raise ValueError(f"alert kind {kind!r} is not one of {', '.join(ALERT_KINDS)}")
    error_text = error if isinstance(error, str) else (f"{type(error).__name__}: {error}" if error else "")
    error_text = scrub(error_text)
    first_line = error_text.strip().splitlines()[0] if error_text.strip() else "(no error text)"
    tail = scrub(remote_log_tail) if remote_log_tail else (tail_from_error(error_text) or error_text)
    if job_id in (None, ""):
        job_id = job_id_from_error(error_text)
    stage = stage_of(task_id, dag_id, default_stage)
    return Alert(
        dag_id=dag_id,
        run_id=scrub(run_id),
        stage=stage,
        task_id=task_id,
        try_number=try_number,
        job_id=scrub(str(job_id)) if job_id not in (None, "") else None,
        error=_truncate(first_line, MAX_ERROR_CHARS),
        log_tail=log_tail(tail, log_lines),
        runbook=runbook_for(stage),
        at=(now or datetime.now(UTC)).isoformat(),
        log_url=log_url,
        kind=kind,
    )


def alert_from_context(context: Mapping[str, Any], *, default_stage: str | None = None, log_lines: int = 40,
                       now: datetime | None = None, log=None) -> Alert:
    """Reads the failure from an Airflow callback context: the task instance (``ti``), its XComs
    ``slurm_job_id``/``job_id`` and ``log_tail``, and ``exception`` (task callbacks) or ``reason`` (DAG
    callbacks). An XCom that cannot be read is logged and left out."""
    ti = context.get("ti") or context.get("task_instance")
    dag = context.get("dag")
    dag_run = context.get("dag_run")
    dag_id = (getattr(ti, "dag_id", None) or getattr(dag, "dag_id", None) or getattr(dag_run, "dag_id", None)
              or "unknown")
    run_id = (context.get("run_id") or getattr(ti, "run_id", None) or getattr(dag_run, "run_id", None)
              or "unknown")
    error = context.get("exception") or context.get("reason")

    def pull(key: str) -> Any:
        if ti is None:
            return None
        try:
            return ti.xcom_pull(task_ids=ti.task_id, key=key)
        except Exception as exc:  # the alert must go out even when the XCom backend does not answer
            if log is not None:
                log.warning("On-call alert: could not read XCom %s of %s: %s", key, ti.task_id, exc)
            return None

    job_id = next((value for value in map(pull, JOB_ID_XCOM_KEYS) if value not in (None, "")), None)
    remote_tail = getattr(error, LOG_TAIL_XCOM_KEY, None) or pull(LOG_TAIL_XCOM_KEY)
    try:
        log_url = getattr(ti, "log_url", None) if ti is not None else None
    except Exception:  # log_url needs the api base URL from the config; the alert is complete without it
        log_url = None
    return build_alert(
        dag_id=dag_id, run_id=str(run_id), task_id=getattr(ti, "task_id", None),
        try_number=getattr(ti, "try_number", None), error=error, job_id=job_id,
        remote_log_tail=remote_tail if isinstance(remote_tail, str) else None, default_stage=default_stage,
        log_lines=log_lines, log_url=log_url if isinstance(log_url, str) else None, now=now,
    )


def should_send(sent_at: Mapping[str, float], key: str, now: float, window_s: float) -> bool:
    """False when ``key`` was sent less than ``window_s`` seconds before ``now``."""
    last = sent_at.get(key)
    return last is None or now - last >= window_s


def record_sent(sent_at: Mapping[str, float], key: str, now: float, window_s: float) -> dict[str, float]:
    """The dedup state after sending ``key`` at ``now``; entries older than the window are dropped."""
    kept = {k: v for k, v in sent_at.items() if now - v < window_s and k != key}
    kept[key] = now
    return kept


def claim(state_file: Path, key: str, now: float, window_s: float) -> bool:
    """Atomically (under an exclusive lock on the state file) decides whether ``key`` may be sent now and,
    if so, records it; concurrent callbacks of the same stage send once."""
    state_file.parent.mkdir(parents=True, exist_ok=True)
    with open(state_file, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        state = _read_state(handle)
        if not should_send(state, key, now, window_s):
            return False
        _write_state(handle, record_sent(state, key, now, window_s))
        return True


def release(state_file: Path, key: str) -> None:
    """Forgets that ``key`` was sent (its delivery failed), so the next failure of the stage is sent."""
    with open(state_file, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        state = _read_state(handle)
        state.pop(key, None)
        _write_state(handle, state)


def _read_state(handle) -> dict[str, float]:
    """The dedup state; a damaged file counts as empty (at worst one alert too many, never one too few)."""
    handle.seek(0)
    try:
        state = json.loads(handle.read() or "{}")
    except json.JSONDecodeError:
        return {}
    if not isinstance(state, dict):
        return {}
    return {key: float(value) for key, value in state.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def _write_state(handle, state: Mapping[str, float]) -> None:
    handle.seek(0)
    handle.truncate()
    json.dump(dict(state), handle)
    handle.flush()
    os.fsync(handle.fileno())


def default_alerts_file() -> Path:
    """HYBRIDFLOW_ALERTS_FILE, else ``<HYBRIDFLOW_STORAGE_ROOT>/alerts/alerts.jsonl``. Read from the environment,
    not the pipeline config: an alert must leave even when the config is what broke."""
    configured = os.environ.get(ALERTS_FILE_ENV)
    if configured:
        return Path(configured)
    return Path(StorageLayout(os.environ.get("HYBRIDFLOW_STORAGE_ROOT") or DEFAULT_STORAGE_ROOT).alerts_file)


def append_alert(path: Path, alert: Alert) -> None:
    """One JSON line per alert; a single ``write`` of a line under ``O_APPEND`` keeps lines whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(alert.to_json(), sort_keys=True) + "\n").encode()
    # 0o660: every member of the storage group (the stack's user, on-call tools, tests) appends to the same file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o660)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def webhook_url(conn) -> str:
    """The webhook's URL from an ``http`` connection: ``host`` as a full URL, or ``schema`` (http/https,
    default https), ``host`` and ``port``; ``extra.endpoint`` is appended as the path."""
    host = (conn.host or "").strip()
    if not host:
        raise ValueError(f"connection {conn.conn_id!r} has no host: set the webhook's URL as its host")
    if "://" in host:
        base = host.rstrip("/")
    else:
        scheme = conn.schema if conn.schema in ("http", "https") else "https"
        base = f"{scheme}://{host}" + (f":{conn.port}" if conn.port else "")
    endpoint = (conn.extra_dejson.get("endpoint") or "").strip()
    return base + ("/" + endpoint.lstrip("/") if endpoint else "")


def post_webhook(conn, alert: Alert, timeout_s: float = WEBHOOK_TIMEOUT_S) -> int:
    """POSTs the alert as JSON (``{"text": ...}`` only when ``extra.payload`` is ``slack``); the connection's
    password, if any, goes as a bearer token. Returns the HTTP status; raises on anything but 2xx."""
    payload = {"text": alert.text()} if conn.extra_dejson.get("payload") == "slack" else alert.to_json()
    headers = {"Content-Type": "application/json"}
    if conn.password:
        headers["Authorization"] = f"Bearer {conn.password}"
    request = urllib.request.Request(webhook_url(conn), data=json.dumps(payload).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (URL from config)
            return response.status
    except urllib.error.HTTPError as exc:
        # The URL may carry a token (Slack puts it in the path): name the connection, never the URL.
        raise RuntimeError(f"webhook of connection {conn.conn_id!r} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RuntimeError(f"webhook of connection {conn.conn_id!r} unreachable: {reason}") from None


class OnCallNotifier(BaseNotifier):
    """
    Sends an on-call alert when a task (or a DAG run) fails; see the module's docstring for what it says.

    :param sink_conn_id: an ``http`` connection of a webhook to POST the alert to; None: the local sink only.
    :param dedup_window_s: a stage of a DAG run alerts at most once in this many seconds; repeats (its
        retries) are logged as suppressed. Another run failing in the same stage alerts on its own.
    :param state_dir: where the dedup state is kept (default: beside the alerts file).
    :param alerts_file: the local sink (default: HYBRIDFLOW_ALERTS_FILE, else
        ``<HYBRIDFLOW_STORAGE_ROOT>/alerts/alerts.jsonl``).
    :param stage: the stage of tasks outside the stages' task groups (e.g. ``router`` for the router DAG).
    :param log_lines: how many of the remote log's last lines the alert carries.
    """

    def __init__(self, sink_conn_id: str | None = None, dedup_window_s: float = 3600,
                 state_dir: str | None = None, alerts_file: str | None = None, stage: str | None = None,
                 log_lines: int = 40, clock=time.time):
        super().__init__()
        if dedup_window_s < 0:
            raise ValueError(f"dedup_window_s: {dedup_window_s} is negative")
        if log_lines < 1:
            raise ValueError(f"log_lines: {log_lines}; the alert carries at least one log line")
        self.sink_conn_id = sink_conn_id
        self.dedup_window_s = dedup_window_s
        self.state_dir = state_dir
        self.alerts_file = alerts_file
        self.stage = stage
        self.log_lines = log_lines
        self.clock = clock

    def notify(self, context) -> None:
        now = self.clock()
        self.send(alert_from_context(context, default_stage=self.stage, log_lines=self.log_lines,
                                     now=datetime.fromtimestamp(now, UTC), log=self.log), now)

    def send(self, alert: Alert, now: float | None = None) -> None:
        """Delivers ``alert`` (a failure's, or an action's built with :func:`build_alert`) to the local sink and
        the webhook, once per dedup key within the window."""
        now = self.clock() if now is None else now
        alerts_file = Path(self.alerts_file) if self.alerts_file else default_alerts_file()
        state_file = Path(self.state_dir or alerts_file.parent) / DEDUP_STATE_NAME
        if not claim(state_file, alert.dedup_key, now, self.dedup_window_s):
            self.log.info("On-call alert suppressed (stage %s of %s run %s already alerted within %.0f s): %s",
                          alert.stage, alert.dag_id, alert.run_id, self.dedup_window_s, alert.error)
            return
        self.log.warning("On-call alert:\n%s", alert.text())
        try:
            append_alert(alerts_file, alert)
        except OSError as exc:
            if not self.sink_conn_id:
                release(state_file, alert.dedup_key)
                raise
            self.log.warning("On-call alert: the local sink %s is not writable (%s); sending to the webhook",
                             alerts_file, exc)
        if self.sink_conn_id:
            from airflow.sdk import BaseHook

            try:
                status = post_webhook(BaseHook.get_connection(self.sink_conn_id), alert)
            except Exception:
                release(state_file, alert.dedup_key)
                raise
            self.log.info("On-call alert sent to the webhook of connection %s (HTTP %s)", self.sink_conn_id,
                          status)


def send_task_alert(ti: Any, alerts: Any, *, kind: str, error: str, details: str, job_id: Any = None) -> None:
    """An on-call alert about something task instance ``ti`` did (a stall, a node left out, a release held),
    through the sinks of ``alerts`` (the pipeline config's ``alerts`` section, which the caller reads)."""
    alert = build_alert(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, try_number=ti.try_number,
                        error=error, job_id=job_id, remote_log_tail=details, log_lines=alerts.log_lines, kind=kind)
    OnCallNotifier(sink_conn_id=alerts.sink_conn_id or None, dedup_window_s=alerts.dedup_window_s).send(alert)
