"""Shared fixtures. Integration tests use the real local stack brought up by scripts/localstack.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state"))
LOCALSTACK = [sys.executable, str(REPO / "scripts" / "localstack.py")]
RUNNER = REPO / "tests" / "integration" / "airflow_runner.py"
sys.path.insert(0, str(REPO / "scripts"))  # the REST client shared with `make demo`
# Spark drivers the tests start in their own process bind loopback, like the stack's (no port on the network).
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def stack_environment() -> dict[str, str]:
    """The environment `make up` wrote for Airflow: AIRFLOW_HOME, AIRFLOW_CONN_* and HYBRIDFLOW_*."""
    path = STATE / "airflow-env.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make up` (the README's test command does it for you)")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def stack(request) -> dict[str, str]:
    """Brings every service of the local stack up once per session (a no-op when `make up` already did)."""
    up = subprocess.run([*LOCALSTACK, "up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"local stack did not come up:\n{up.stdout}\n{up.stderr}")
    env = stack_environment()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def api(stack):
    """A REST client logged in to the running local Airflow as admin, as the UI and `make demo` use it."""
    from airflow_api import local_api

    return local_api()


@pytest.fixture(scope="session")
def isolated_airflow_env(stack, tmp_path_factory) -> dict[str, str]:
    """An Airflow home of its own (SQLite, migrated once) with the stack's connections."""
    home = tmp_path_factory.mktemp("airflow_home")
    (home / "dags").mkdir()
    env = dict(os.environ, AIRFLOW_HOME=str(home),
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env, check=True,
                   capture_output=True)
    return env


@pytest.fixture
def run_dag(isolated_airflow_env):
    """Write a DAG file and run its DAG once through Airflow's real task lifecycle (dag.test, triggers inline)."""

    def run(source: str, dag_id: str, conf: dict | None = None, timeout_s: float = 600, logical_date: str = "",
            background: bool = False):
        dag_file = Path(isolated_airflow_env["AIRFLOW__CORE__DAGS_FOLDER"]) / f"{dag_id}.py"
        dag_file.write_text(source)
        argv = [sys.executable, str(RUNNER), str(dag_file), dag_id, json.dumps(conf or {}), logical_date]
        if background:  # the caller kills it: a task process dying mid-wait
            return subprocess.Popen(argv, env=isolated_airflow_env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        out = subprocess.run(argv, env=isolated_airflow_env, capture_output=True, text=True, timeout=timeout_s)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            pytest.fail(
                f"DAG run produced no result (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        result["log"] = out.stdout + out.stderr
        return result

    return run
