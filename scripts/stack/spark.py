"""Spark standalone: a master and a worker from the pyspark wheel, run as the service user."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from .common import (
    SERVICE_USER,
    STACK,
    VENV,
    P,
    Service,
    ensure_dir,
    port_open,
    spawn,
)
from .system import give_to_service_user


def spark_home() -> Path:
    found = sorted((VENV / "lib").glob("python3*/site-packages/pyspark"))
    if not found:
        raise RuntimeError(f"pyspark is not installed in {VENV}; run `make venv` first")
    return found[0]


def spark_env() -> dict:
    return dict(
        os.environ, SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(P.spark / "logs"),
        SPARK_WORKER_DIR=str(P.spark / "work"), PYSPARK_PYTHON=str(VENV / "bin/python"),
        PATH=f"{VENV / 'bin'}:{os.environ['PATH']}",
    )


def spark_class(cls: str, args: list[str], logname: str) -> int:
    """Run a Spark daemon in the foreground of its own session (spark-class execs java: the PID is the JVM's)."""
    env = spark_env()
    for sub in ("logs", "work"):
        ensure_dir(P.spark / sub, owner=SERVICE_USER, mode=0o700)
    ensure_dir(P.spark, owner=SERVICE_USER, mode=0o700)
    give_to_service_user(P.spark)
    # The service user's: executors write features into the shared storage, as the drivers that commit them.
    return spawn([f"{env['SPARK_HOME']}/bin/spark-class", cls, *args], P.logs / logname, env=env,
                 service_user=True)


def start_spark_master() -> int:
    return spark_class("org.apache.spark.deploy.master.Master", [
        "--host", "127.0.0.1", "--port", str(STACK["spark_master_port"]),
        "--webui-port", str(STACK["spark_master_ui_port"]),
    ], "spark-master.log")


def start_spark_worker() -> int:
    # The worker retries its registration, so it need not wait for the master.
    return spark_class("org.apache.spark.deploy.worker.Worker", [
        "--host", "127.0.0.1", "--cores", str(STACK["spark_worker_cores"]), "--memory", STACK["spark_worker_memory"],
        "--webui-port", str(STACK["spark_worker_ui_port"]), f"spark://127.0.0.1:{STACK['spark_master_port']}",
    ], "spark-worker.log")


def spark_worker_ready() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{STACK['spark_master_ui_port']}/json/", timeout=5) as resp:
            return any(w.get("state") == "ALIVE" for w in json.load(resp).get("workers", []))
    except (OSError, ValueError):
        return False


def services() -> list[Service]:
    return [
        Service("spark-master", lambda: port_open(STACK["spark_master_port"]), start_spark_master, comm="java",
                endpoint=f"spark://127.0.0.1:{STACK['spark_master_port']}", logfile=P.logs / "spark-master.log"),
        Service("spark-worker", spark_worker_ready, start_spark_worker, comm="java",
                endpoint=f"http://127.0.0.1:{STACK['spark_worker_ui_port']}", logfile=P.logs / "spark-worker.log"),
    ]
