"""The Spark stages run the way Airflow runs them (`spark-submit jobs/<name>.py ...` with this interpreter), on
local[2] or the stack's standalone master, and the raw data they read, from the project's generator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.partitions import manifest

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "jobs"
BIN = Path(sys.executable).parent
DS_PREV, DS = "2026-01-04", "2026-01-05"
ROWS, CUSTOMERS = 20_000, 1_000
STANDALONE_MASTER = "spark://127.0.0.1:7077"
STANDALONE_UI = "http://127.0.0.1:8081/json/"
# The raw events' columns (jobs/hybridjobs/generator.py's RAW_COLUMNS, written out), every one binary.
RAW_NAMES = ("event_id", "customer_id", "event_ts", "event_type", "amount", "channel", "device", "country")
# Small data: the JVM's C2 compiler would cost more CPU than it saves (about half of a job's CPU here), on cores
# shared with other work.
QUICK_JIT = "-XX:TieredStopAtLevel=1"


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    # Executors start their Python workers with this interpreter (it has torch, pandas, pyarrow).
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def spark_command(script: str, *args: str, master: str = "local[2]", conf: dict[str, str] | None = None) -> list[str]:
    """The spark-submit command line of ``script`` with ``args`` on ``master``; ``conf``: more Spark settings."""
    command = [str(BIN / "spark-submit"), "--master", master, "--driver-memory", "1g",
               "--driver-java-options", QUICK_JIT,
               "--conf", "spark.ui.enabled=false", "--conf", "spark.log.level=WARN",
               # Standalone executors run as the stack's service user, this driver as root: what the driver
               # creates (the _temporary folders) must be group-writable, and Hadoop applies its own umask.
               "--conf", "spark.hadoop.fs.permissions.umask-mode=002"]
    if master.startswith("spark://"):
        command += ["--conf", "spark.executor.memory=1g", "--conf", "spark.cores.max=2",
                    "--conf", f"spark.executor.extraJavaOptions={QUICK_JIT}"]
    for key, value in (conf or {}).items():
        command += ["--conf", f"{key}={value}"]
    return [*command, script, *args]


def spark_submit(script: str, *args: str, master: str = "local[2]", timeout: int = 600) -> str:
    """Runs ``script`` under spark-submit to its end; its stdout, or the test fails with its output."""
    command = spark_command(script, *args, master=master)
    done = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {done.returncode}\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout


def generate(root: Path, ds: str, rows: int = ROWS, customers: int = CUSTOMERS) -> dict:
    """A published raw partition of ``ds`` from jobs/generate_raw.py; its manifest."""
    done = subprocess.run([sys.executable, str(JOBS / "generate_raw.py"), "--root", str(root), "--ds", ds,
                           "--rows", str(rows), "--customers", str(customers)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return manifest(root, "raw", ds)


def standalone_master_alive() -> str | None:
    """None when the standalone master answers with an alive worker, else why not."""
    try:
        with urllib.request.urlopen(STANDALONE_UI, timeout=5) as resp:
            state = json.load(resp)
    except OSError as err:
        return f"{STANDALONE_UI} does not answer ({err}); the shared stack may be restarting"
    if not state.get("aliveworkers"):
        return f"{STANDALONE_MASTER} has no alive worker"
    return None


def require_standalone_master(wait_s: float = 30.0, poll_s: float = 2.0) -> None:
    """Fails the test (never skips it) unless the standalone master answers with an alive worker within
    ``wait_s`` seconds (a worker re-registering after a restart gets that long)."""
    deadline = time.monotonic() + wait_s
    why_not = standalone_master_alive()
    while why_not and time.monotonic() < deadline:
        time.sleep(poll_s)
        why_not = standalone_master_alive()
    if why_not:
        pytest.fail(f"Spark standalone is not usable after {wait_s:.0f} s: {why_not}. The local stack runs the "
                    f"master ({STANDALONE_MASTER}, UI {STANDALONE_UI}) and one worker: check "
                    "`python scripts/localstack.py status` and .state/logs/spark-*.log.", pytrace=False)
