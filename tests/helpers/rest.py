"""The running local Airflow's REST API for the tests: scripts/airflow_api.py's client (what `make demo` uses) plus
what the tests need and it lacks: every answer as (HTTP status, body), refusals included, never an exception."""

from __future__ import annotations

import json
import time
import urllib.error
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
