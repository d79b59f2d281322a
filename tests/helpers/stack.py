"""The local stack (scripts/localstack.py) as the tests drive it: its command, one service stopped and started
again, a client of its S3 endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCALSTACK = [sys.executable, str(REPO / "scripts" / "localstack.py")]


def localstack(action: str, service: str, timeout_s: float = 180) -> None:
    """``localstack.py <action> <service>`` (``up`` or ``down``); raises saying its output when it fails."""
    done = subprocess.run([*LOCALSTACK, action, service], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"localstack {action} {service} failed:\n{done.stdout}\n{done.stderr}")


@contextmanager
def service_down(service: str):
    """Stops one service of the local stack and always brings it back, even when the test fails."""
    localstack("down", service)
    try:
        yield
    finally:
        localstack("up", service)


def s3_client(stack: dict[str, str]):
    """(boto3 S3 client, connection dict) of the stack's S3 endpoint, from its ``storage_s3`` connection."""
    import boto3

    conn = json.loads(stack["AIRFLOW_CONN_STORAGE_S3"])
    s3 = boto3.client("s3", endpoint_url=conn["extra"]["endpoint_url"], aws_access_key_id=conn["login"],
                      aws_secret_access_key=conn["password"], region_name="us-east-1")
    return s3, conn
