#!/usr/bin/env python3
"""Trigger a DAG on the running local Airflow through its REST API and follow it to the end.

    .venv/bin/python scripts/demo.py [--dag DAG_ID] [--conf JSON] [--timeout SECONDS]

Prints one line per task state change and a summary; exits non-zero when the run fails. `make demo` runs it
after `make up`; the Airflow UI stays up until `make down`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state"))
DEFAULT_DAG = "platform_healthcheck"


class AirflowApi:
    """The few REST calls the demo needs, with a JWT from the simple auth manager."""

    def __init__(self, base_url: str, username: str, password: str):
        self.base_url = base_url.rstrip("/")
        token = self._request("POST", "/auth/token", {"username": username, "password": password}, auth=False)
        self.token = token["access_token"]

    def _request(self, method: str, path: str, body: dict | None = None, auth: bool = True):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{method} {path} -> HTTP {exc.code}: {detail}") from exc

    def get(self, path: str):
        return self._request("GET", path)

    def post(self, path: str, body: dict):
        return self._request("POST", path, body)

    def patch(self, path: str, body: dict):
        return self._request("PATCH", path, body)


def wait_for_dag(api: AirflowApi, dag_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return api.get(f"/api/v2/dags/{dag_id}")
        except RuntimeError as exc:
            if "404" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def follow(api: AirflowApi, dag_id: str, run_id: str, timeout_s: float) -> str:
    seen: dict[str, str] = {}
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        for ti in sorted(tis, key=lambda t: t.get("start_date") or "~"):
            state = ti.get("state") or "none"
            if seen.get(ti["task_id"]) != state:
                seen[ti["task_id"]] = state
                took = f" ({ti['duration']:.1f} s)" if ti.get("duration") else ""
                print(f"[{time.monotonic() - started:6.1f} s] {ti['task_id']:<40} {state}{took}", flush=True)
        run = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run["state"]
        time.sleep(2)
    raise RuntimeError(f"run {run_id} of {dag_id} did not finish within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dag", default=DEFAULT_DAG)
    parser.add_argument("--conf", default="{}", help="run conf as JSON (the DAG's params)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)

    env = json.loads((STATE / "airflow-env.json").read_text())
    base_url = env["AIRFLOW__API__BASE_URL"]
    password = json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())["admin"]
    api = AirflowApi(base_url, "admin", password)

    t0 = time.monotonic()
    wait_for_dag(api, args.dag)
    api.patch(f"/api/v2/dags/{args.dag}", {"is_paused": False})
    run = api.post(f"/api/v2/dags/{args.dag}/dagRuns", {"logical_date": None, "conf": json.loads(args.conf)})
    run_id = run["dag_run_id"]
    print(f"triggered {args.dag} run {run_id}", flush=True)
    state = follow(api, args.dag, run_id, args.timeout)
    print()
    print(f"{args.dag}: {state.upper()} in {time.monotonic() - t0:.0f} s")
    print(f"UI: {base_url}/dags/{args.dag}/runs/{run_id}  (login admin, password in "
          f"{env['AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE']})")
    print("The stack keeps running; `make down` stops it.")
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
