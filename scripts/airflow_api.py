"""A small client of the local Airflow's REST API (JWT from the simple auth manager), for the demo and benchmarks."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state"))


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
                payload = resp.read()
                return json.loads(payload) if payload else None  # 204 No Content (a DELETE)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{method} {path} -> HTTP {exc.code}: {detail}") from exc

    def get(self, path: str):
        return self._request("GET", path)

    def post(self, path: str, body: dict):
        return self._request("POST", path, body)

    def patch(self, path: str, body: dict):
        return self._request("PATCH", path, body)

    def delete(self, path: str):
        return self._request("DELETE", path)


def wait_for_dag(api: AirflowApi, dag_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return api.get(f"/api/v2/dags/{dag_id}")
        except RuntimeError as exc:
            if "404" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)




def local_api() -> AirflowApi:
    """A client logged in to this checkout's Airflow as admin (see .state/airflow-env.json)."""
    env = json.loads((STATE / "airflow-env.json").read_text())
    password = json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())["admin"]
    return AirflowApi(env["AIRFLOW__API__BASE_URL"], "admin", password)


def trigger(api: AirflowApi, dag_id: str, conf: dict, logical_date: str | None = None) -> str:
    """Unpause the DAG and start a run (for ``logical_date`` when given); returns its run id."""
    wait_for_dag(api, dag_id)
    api.patch(f"/api/v2/dags/{dag_id}", {"is_paused": False})
    body = {"logical_date": logical_date, "conf": conf}
    return api.post(f"/api/v2/dags/{dag_id}/dagRuns", body)["dag_run_id"]


def wait_for_run(api: AirflowApi, dag_id: str, run_id: str, timeout_s: float, poll_s: float = 1.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
        if state in ("success", "failed"):
            return state
        time.sleep(poll_s)
    raise RuntimeError(f"run {run_id} of {dag_id} did not finish within {timeout_s:.0f} s")


def task_states(api: AirflowApi, dag_id: str, run_id: str) -> dict[str, str]:
    """State of every task instance of a run, by task id (mapped tasks collapse to their last index)."""
    tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")["task_instances"]
    return {ti["task_id"]: ti["state"] for ti in tis}


def xcom(api: AirflowApi, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
    """One XCom value of a task instance of a run, deserialized by the API."""
    return api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")["value"]


def task_log(api: AirflowApi, dag_id: str, run_id: str, task_id: str, last: int = 40) -> str:
    """The last lines of a task instance's log, every try, as the UI shows them (for a failure's message)."""
    path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
    lines = []
    for try_number in range(1, api.get(path)["try_number"] + 1):
        for entry in api.get(f"{path}/logs/{try_number}")["content"]:
            if entry.get("timestamp"):  # the source-details group has none
                lines.append(f"try {try_number} {entry['timestamp'][11:19]} {entry['event']}")
    return "\n".join(lines[-last:])
