"""The running local Airflow's REST API for the tests: scripts/airflow_api.py's client (what `make demo` uses) plus
what the tests need and it lacks: every answer as (HTTP status, body), refusals included, never an exception."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

from airflow_api import AirflowApi, local_api


def call(api: AirflowApi, method: str, path: str, body: dict | str | None = None,
         timeout_s: float = 60) -> tuple[int, dict]:
    """One request with ``api``'s token: (HTTP status, JSON body). An empty body reads ``{}``, an error body
    that is not JSON ``{"detail": <its text>}``. A str ``body`` is sent as it is: raw JSON text, exactly as a
    client may write it (1e400, NaN)."""
    data = body if isinstance(body, str) else json.dumps(body) if body is not None else None
    req = urllib.request.Request(api.base_url + path, method=method, data=data.encode() if data else None)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {api.token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"detail": raw.decode(errors="replace")}


def local_api_when_up(timeout_s: float = 180) -> AirflowApi:
    """``local_api()``, asked again every 2 s for up to ``timeout_s``: the api-server restarts when `make up`
    finds its environment changed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return local_api()
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


UNFINISHED = {"scheduled", "queued", "running", "deferred", "up_for_retry", "up_for_reschedule", "restarting",
              "awaiting_input"}


def remove_run(api: AirflowApi, dag_id: str, run_id: str, timeout_s: float = 90, grace_s: float = 5) -> None:
    """Removes a test's run from the stack's Airflow: marked failed, then deleted once none of its tasks is
    unfinished and, where a task had started, the executor has had ``grace_s`` to report its process's end.
    Deleted at once, a run whose last task just ended can vanish under the scheduler while it handles that task's
    executor event (sqlalchemy ObjectDeletedError), which kills the scheduler for every test after it."""
    path = f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
    status, run = call(api, "GET", path)
    if status == 404:
        return
    if run.get("state") not in ("success", "failed"):
        call(api, "PATCH", path, {"state": "failed"})
    deadline, started = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        status, body = call(api, "GET", f"{path}/taskInstances")
        instances = body.get("task_instances", []) if status == 200 else []
        started = any(ti.get("start_date") for ti in instances)
        if not UNFINISHED & {ti.get("state") for ti in instances}:
            break
        time.sleep(1)
    if started:  # a run none of whose tasks ever started leaves the executor nothing to report
        time.sleep(grace_s)
    call(api, "DELETE", path)
