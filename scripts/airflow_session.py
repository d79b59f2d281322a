"""This checkout's Airflow through Airflow's official Python client (apache-airflow-client): how the demo and the
benchmarks trigger and follow runs. Tests that assert status codes keep the raw HTTP helper in airflow_api.py."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from airflow_api import STATE
from airflow_client.client import ApiClient, Configuration
from airflow_client.client.api.dag_api import DAGApi
from airflow_client.client.api.dag_run_api import DagRunApi
from airflow_client.client.api.task_instance_api import TaskInstanceApi
from airflow_client.client.api.x_com_api import XComApi
from airflow_client.client.exceptions import NotFoundException
from airflow_client.client.models.dag_patch_body import DAGPatchBody
from airflow_client.client.models.trigger_dag_run_post_body import TriggerDAGRunPostBody

FINISHED = ("success", "failed")


def simple_auth_token(base_url: str, username: str, password: str) -> str:
    """A JWT from the simple auth manager's token endpoint, which the public API (and so its client) leaves out."""
    request = urllib.request.Request(f"{base_url}/auth/token", method="POST",
                                     data=json.dumps({"username": username, "password": password}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)["access_token"]


@dataclass
class Airflow:
    """One logged-in client and the API groups the callers use."""

    base_url: str
    client: ApiClient

    @cached_property
    def dags(self) -> DAGApi:
        return DAGApi(self.client)

    @cached_property
    def runs(self) -> DagRunApi:
        return DagRunApi(self.client)

    @cached_property
    def task_instances(self) -> TaskInstanceApi:
        return TaskInstanceApi(self.client)

    @cached_property
    def xcoms(self) -> XComApi:
        return XComApi(self.client)

    def wait_for_dag(self, dag_id: str, timeout_s: float = 120) -> None:
        """Until the DAG processor has parsed ``dag_id`` (a fresh stack parses its DAGs in the background)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.dags.get_dag(dag_id)
                return
            except NotFoundException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)

    def trigger(self, dag_id: str, conf: dict, logical_date: str | None = None) -> str:
        """Unpause the DAG and start a run (for ``logical_date`` when given); returns its run id."""
        self.wait_for_dag(dag_id)
        self.dags.patch_dag(dag_id, DAGPatchBody(is_paused=False))
        body = TriggerDAGRunPostBody(conf=conf, logical_date=logical_date)
        return self.runs.trigger_dag_run(dag_id, body).dag_run_id

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.runs.get_dag_run(dag_id, run_id).state.value

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float, poll_s: float = 1.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run_state(dag_id, run_id)
            if state in FINISHED:
                return state
            time.sleep(poll_s)
        raise RuntimeError(f"run {run_id} of {dag_id} did not finish within {timeout_s:.0f} s")

    def task_instances_of(self, dag_id: str, run_id: str) -> list:
        return self.task_instances.get_task_instances(dag_id, run_id, limit=100).task_instances

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value"):
        """One XCom value of a task instance, or None when the task was skipped or returned nothing."""
        try:
            return self.xcoms.get_xcom_entry(dag_id, task_id, run_id, key).actual_instance.value
        except NotFoundException:
            return None


def local_airflow() -> Airflow:
    """A client logged in to this checkout's Airflow as admin (see .state/airflow-env.json)."""
    env = json.loads((STATE / "airflow-env.json").read_text())
    password = json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())["admin"]
    base_url = env["AIRFLOW__API__BASE_URL"].rstrip("/")
    configuration = Configuration(host=base_url, access_token=simple_auth_token(base_url, "admin", password))
    return Airflow(base_url, ApiClient(configuration))
