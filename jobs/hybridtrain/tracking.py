"""Experiment tracking of a training run, on rank 0, never in the way of training.

Every figure the loop records (loss, rows/s, holdout AUC at checkpoints) goes to ``<run_dir>/step_metrics.jsonl``,
one JSON line per record. When the run config names an MLflow run (``tracking``), a background thread also logs
the same figures to that run while the job runs, batched (one ``runs/log-batch`` call per ``flush_every_s``), so
the loss curve grows in the MLflow UI. Tracking never breaks training: when the server cannot be reached (common
on HPC compute nodes) or refuses, the job says so once and stops trying; the Airflow task then logs from the file
what the server has not got (``hybridflow.operators.training``). Both sides log only steps above the highest step the
run already holds for a metric, so a resumed job or a retried task adds no point twice.

The client speaks MLflow's REST API (``/api/2.0/mlflow``) with the standard library: two calls are all the job
needs, and the cluster's job environment stays free of the MLflow package and its dependencies. Credentials come
from a 0600 file the Airflow task writes into the run directory; they never reach the command line, the batch
script or a log line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridjobs.layout import STEP_METRICS_FILE

__all__ = [
    "LiveTracking",
    "MlflowRest",
    "StepMetricsLog",
    "TrackingConfig",
    "TrackingUnavailable",
    "code_version",
    "open_step_log",
    "parse_tracking",
]

log = logging.getLogger("hybridtrain")

_RUN_ID = re.compile(r"[0-9a-f]{32}")
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one runs/log-batch call


@dataclass(frozen=True)
class TrackingConfig:
    """Where rank 0 logs live: the server's base URL, the MLflow run id, and the credentials file (JSON with
    ``username`` and ``password``, mode 0600); no file means a server without authentication."""

    uri: str
    run_id: str
    credentials_file: Path | None = None
    flush_every_s: float = 5.0


def parse_tracking(value: Any, base_dir: Path, problems: list[str]) -> TrackingConfig | None:
    """The run config's ``tracking`` object (absent or null: no live tracking); every bad field in ``problems``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"tracking: must be an object with uri and run_id, got {value!r}")
        return None
    found: list[str] = []
    unknown = sorted(set(value) - {"uri", "run_id", "credentials_file", "flush_every_s"})
    for key in unknown:
        found.append(f"tracking.{key}: unknown field (known: credentials_file, flush_every_s, run_id, uri)")
    uri = value.get("uri")
    parsed = urllib.parse.urlsplit(uri) if isinstance(uri, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.username:
        found.append(f"tracking.uri: must be an http(s) URL of the MLflow server without credentials, got {uri!r}")
    run_id = value.get("run_id")
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        found.append(f"tracking.run_id: must be an MLflow run id (32 hex digits), got {run_id!r}")
    credentials = value.get("credentials_file")
    if credentials is not None and (not isinstance(credentials, str) or not credentials.strip()):
        found.append(f"tracking.credentials_file: must be a path when given, got {credentials!r}")
    flush = value.get("flush_every_s", 5.0)
    if isinstance(flush, bool) or not isinstance(flush, int | float) or not math.isfinite(flush) or flush <= 0:
        found.append(f"tracking.flush_every_s: must be a finite number > 0, got {flush!r}")
    problems.extend(found)
    if found:
        return None
    return TrackingConfig(
        uri=uri.rstrip("/"),
        run_id=run_id,
        credentials_file=None if credentials is None else (base_dir / credentials).resolve(),
        flush_every_s=float(flush),
    )


class TrackingUnavailable(Exception):
    """The MLflow server could not be reached or refused a call; the message says which and why."""


class MlflowRest:
    """The two MLflow REST calls the job makes, over HTTP with basic authentication."""

    def __init__(self, uri: str, username: str | None = None, password: str | None = None,
                 timeout_s: float = 5.0) -> None:
        self.uri = uri.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"

    def _call(self, method: str, endpoint: str, *, query: Mapping[str, str] | None = None,
              payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        body = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(url, data=body, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 (http(s) only)
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise TrackingUnavailable(f"{method} {endpoint} on {self.uri}: HTTP {error.code} {detail}") from None
        except (OSError, ValueError) as error:
            raise TrackingUnavailable(f"{method} {endpoint} on {self.uri}: {error}") from None
        return json.loads(text) if text.strip() else {}

    def highest_step(self, run_id: str, key: str) -> int | None:
        """The highest step the run holds for metric ``key`` (None: no point yet)."""
        found = self._call("GET", "metrics/get-history", query={"run_id": run_id, "metric_key": key})
        steps = [int(point.get("step", 0)) for point in found.get("metrics", [])]
        return max(steps) if steps else None

    def log_metrics(self, run_id: str, metrics: list[dict[str, Any]]) -> None:
        """``metrics``: ``{"key", "value", "timestamp" (ms), "step"}`` records, in batches MLflow accepts."""
        for start in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            batch = metrics[start : start + _MAX_METRICS_PER_BATCH]
            self._call("POST", "runs/log-batch", payload={"run_id": run_id, "metrics": batch})


def read_credentials(path: Path | None) -> tuple[str | None, str | None]:
    """(username, password) from the credentials file, or (None, None) without one."""
    if path is None:
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TrackingUnavailable(f"credentials file {path} unreadable ({type(error).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("username"), str):
        raise TrackingUnavailable(f"credentials file {path} has no username")
    return data["username"], str(data.get("password", ""))


def metric_records(step: int, timestamp_ms: int, figures: Mapping[str, float]) -> list[dict[str, Any]]:
    """MLflow metric records of one step's finite figures (MLflow refuses NaN only in some stores: none sent)."""
    return [
        {"key": key, "value": float(value), "timestamp": timestamp_ms, "step": step}
        for key, value in sorted(figures.items())
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ]


def new_records(records: list[dict[str, Any]], logged: Mapping[str, int | None]) -> list[dict[str, Any]]:
    """The records above the highest step already logged for their metric (a resumed job repeats steps)."""
    return [r for r in records if logged.get(r["key"]) is None or r["step"] > logged[r["key"]]]


class LiveTracking:
    """Logs records to an MLflow run from a daemon thread, one batch per ``flush_every_s``; on the first failure
    it says so once and stops (the Airflow task logs the rest from ``step_metrics.jsonl`` after the job)."""

    def __init__(self, client: MlflowRest, run_id: str, flush_every_s: float = 5.0) -> None:
        self.client = client
        self.run_id = run_id
        self.flush_every_s = flush_every_s
        self.failed: str | None = None
        self.logged_points = 0
        self._pending: list[dict[str, Any]] = []
        self._logged: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="mlflow-live", daemon=True)

    def start(self) -> LiveTracking:
        self._thread.start()
        return self

    def add(self, records: list[dict[str, Any]]) -> None:
        if self.failed is None:
            with self._lock:
                self._pending.extend(records)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is pending (waiting at most ``timeout_s``: the job's end never hangs on the server)."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_every_s)
            closing = self._closing
            try:
                self._flush()
            except TrackingUnavailable as error:
                self.failed = str(error)
                log.warning(
                    "MLflow tracking unavailable (%s): training goes on; the step metrics stay in %s and the "
                    "Airflow task logs them to run %s after the job", error, STEP_METRICS_FILE, self.run_id,
                )
                return
            if closing:
                return

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for key in {record["key"] for record in pending} - set(self._logged):
            self._logged[key] = self.client.highest_step(self.run_id, key)
        fresh = new_records(pending, self._logged)
        if fresh:
            self.client.log_metrics(self.run_id, fresh)
            self.logged_points += len(fresh)
            for record in fresh:
                self._logged[record["key"]] = max(record["step"], self._logged.get(record["key"]) or 0)


class StepMetricsLog:
    """Rank 0's record of the loop's figures: a line per record in ``step_metrics.jsonl``, and to ``live``.

    :param rows_per_step: rows the whole job trains on per optimizer step (rows/s is derived from it).
    """

    def __init__(self, path: Path, rows_per_step: int, live: LiveTracking | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.rows_per_step = rows_per_step
        self.live = live
        self._clock = clock
        self._last: tuple[int, float] | None = None

    def record(self, step: int, figures: Mapping[str, float], *, with_rate: bool = False) -> None:
        now = self._clock()
        figures = dict(figures)
        if with_rate:
            if self._last is not None and step > self._last[0] and now > self._last[1]:
                figures["rows_per_s"] = (step - self._last[0]) * self.rows_per_step / (now - self._last[1])
            self._last = (step, now)
        timestamp_ms = int(now * 1000)
        records = metric_records(step, timestamp_ms, figures)
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, "timestamp_ms": timestamp_ms,
                                   **{r["key"]: r["value"] for r in records}}) + "\n")
        if self.live is not None:
            self.live.add(records)

    def restart_rate(self) -> None:
        """Forget the last point of the rate (after resume or a pause such as a checkpoint)."""
        self._last = None

    def close(self) -> None:
        if self.live is not None:
            self.live.close()


def open_step_log(path: Path, rows_per_step: int, tracking: TrackingConfig | None) -> StepMetricsLog:
    """Rank 0's step figures: the file always, MLflow live when the run config names a run. Unreadable
    credentials leave the file alone: training goes on, and the Airflow task logs the file after the job."""
    live = None
    if tracking is not None:
        try:
            username, password = read_credentials(tracking.credentials_file)
        except TrackingUnavailable as error:
            log.warning("MLflow tracking unavailable (%s): training goes on; the Airflow task logs %s after "
                        "the job", error, path.name)
        else:
            client = MlflowRest(tracking.uri, username, password)
            live = LiveTracking(client, tracking.run_id, tracking.flush_every_s).start()
            log.info("tracking: logging live to MLflow run %s at %s", tracking.run_id, tracking.uri)
    return StepMetricsLog(path, rows_per_step, live)


def code_version(root: Path | None = None) -> str:
    """A digest of the job code that ran (every ``*.py`` under ``jobs/``, paths and contents): the MLflow run's
    code version, the same for the same release on every node."""
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
