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
