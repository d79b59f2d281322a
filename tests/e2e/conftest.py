"""End-to-end: whole DAG runs on the running local Airflow (scheduler, LocalExecutor, triggerer), driven through
its REST API exactly as the UI and `make demo` drive it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from airflow_api import AirflowApi, local_api  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def api(stack) -> AirflowApi:
    return local_api()


def wait_for_state(api: AirflowApi, dag_id: str, run_id: str, timeout_s: float = 900) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run
        time.sleep(2)
    pytest.fail(f"run {run_id} of {dag_id} did not finish in {timeout_s:.0f} s")


def task_states(api: AirflowApi, dag_id: str, run_id: str) -> dict[str, str]:
    tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")["task_instances"]
    return {ti["task_id"]: ti["state"] for ti in tis}


def xcom(api: AirflowApi, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
    return api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")["value"]
