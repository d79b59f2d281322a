"""Airflow's four components (api-server, scheduler, dag-processor, triggerer), run as the service user: their
environment and connections, the metadata database's migration and pools, their health, a restart after their
database came back, the idle executor workers a dead scheduler leaves, and the import of the old file registry into
MLflow."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from string import Template

from .common import (
    JOB_USER,
    METADATA_DB,
    PROF,
    PROFILE,
    REPO,
    SERVICE_USER,
    STACK,
    STATE,
    VENV,
    P,
    Service,
    as_service_user,
    chown,
    ensure_dir,
    http_ok,
    log,
    proc_uid,
    run,
    secret,
    spawn,
    wait_for,
    write_if_changed,
)
from .mlflow import MLFLOW_CLIENT_USER, mlflow_client_password, mlflow_url
from .postgres import metadata_db_url
from .sshd import ensure_host_key
from .system import give_to_service_user


def fill_placeholders(node, values: dict):
    """Replace ${name} in a profile's values; a value that is one whole placeholder keeps its type (ports)."""
    if isinstance(node, dict):
        return {key: fill_placeholders(value, values) for key, value in node.items()}
    if isinstance(node, list):
        return [fill_placeholders(value, values) for value in node]
    if not isinstance(node, str):
        return node
    whole = node.strip()
    if whole.startswith("${") and whole.endswith("}") and whole.count("${") == 1:
        name = whole[2:-1]
        if name not in values:
            raise RuntimeError(
                f"profile {PROFILE}: unknown placeholder ${{{name}}}; known: {', '.join(sorted(values))}")
        return values[name]
    try:
        return Template(node).substitute(values)
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"profile {PROFILE}: bad placeholder in {node!r}: {exc}") from exc


def render_connections() -> dict[str, dict]:
    values = dict(
        STACK,
        ssh_key_file=str(P.ssh_client / "id_ed25519"),
        ssh_host_key=ensure_host_key(),
        known_hosts_file=str(P.ssh_client / "known_hosts"),
        s3_access_key=secret("s3-access-key", P.local_secrets, 12),
        s3_secret_key=secret("s3-secret-key", P.local_secrets),
        mlflow_login=MLFLOW_CLIENT_USER,
        mlflow_password=mlflow_client_password(),
    )
    return {conn_id: fill_placeholders(spec, values) for conn_id, spec in PROF["connections"].items()}


def fernet_key(nbytes: int) -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(nbytes)).decode()


def write_known_hosts(host_key: str) -> None:
    port = STACK["ssh_port"]
    text = "".join(f"[{h}]:{port} {host_key}\n" for h in ("127.0.0.1", "localhost"))
    write_if_changed(P.ssh_client / "known_hosts", text, owner=SERVICE_USER)


def airflow_env() -> dict[str, str]:
    home = P.airflow_home
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": str(STACK["airflow_parallelism"]),
        "AIRFLOW__CORE__FERNET_KEY": secret("fernet-key", P.local_secrets, 32, make=fernet_key),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{STACK['airflow_api_port']}/execution/",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_db_url(),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(STACK["airflow_api_port"]),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{STACK['airflow_api_port']}",
        "AIRFLOW__API__SECRET_KEY": secret("api-secret-key", P.local_secrets),
        "AIRFLOW__API_AUTH__JWT_SECRET": secret("jwt-secret", P.local_secrets, 32),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # The one deferral policy of every Slurm, Triton and checkpoint wait: in the triggerer, not a worker slot.
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        "HYBRIDFLOW_STORAGE_ROOT": str(P.storage),
        "HYBRIDFLOW_CLUSTER_DIR": str(P.cluster),
        "HYBRIDFLOW_JOB_USER": JOB_USER,
        # Written into every Slurm job's key: this checkout's Airflow reconciles only the jobs it submitted.
        "HYBRIDFLOW_DEPLOYMENT": f"local-{hashlib.sha256(str(STATE).encode()).hexdigest()[:12]}",
        "HYBRIDFLOW_SERVICE_USER": SERVICE_USER,
        "HYBRIDFLOW_CLUSTER_PYTHON": str(P.cluster_venv / "bin/python"),
        "HYBRIDFLOW_CLUSTER_JOBS_DIR": str(P.cluster_code / "jobs"),
        "HYBRIDFLOW_STATE_DIR": str(STATE),
        "PYSPARK_PYTHON": str(VENV / "bin/python"),
        # Spark drivers that tasks launch (spark-submit, client mode) bind their ports and UI to loopback.
        "SPARK_LOCAL_IP": "127.0.0.1",
        # No upstream producer here: the nightly pipeline generates the day's raw events itself.
        "HYBRIDFLOW_SIMULATE_RAW": "true",
        # Loopback gloo on 2 shared cores spends ~20-30% of a small model's step in all-reduce (pipeline.yaml), and
        # 55-58% while the test suite loads the cores (measured 2026-12-04, 2 nodes x 1 rank): latency, not a network
        # fault, so the local limit leaves room for it.
        "HYBRIDFLOW_MAX_ALLREDUCE_SHARE": "0.75",
        # The realtime SLO of the gates (50 ms in production): on 2 shared cores while the suite's lanes load them
        # the deploy gate measured a 1-ms model's p99 at 170-350 ms (p50 30-57 ms) on the serving version and the
        # candidate alike (2026-12-07). 50 ms held every release there: the judge was right, the box is too small.
        "HYBRIDFLOW_SLO_P99_MS": "500",
        # node-local scratch of each Slurm node (the same disk here), probed by the node self-check
        "HYBRIDFLOW_NODE_SCRATCH_DIR": f"{P.node_scratch}/%n",
        # MLflow's client reads these: the tracking server, and Airflow's own MLflow account (not the admin).
        "MLFLOW_TRACKING_URI": mlflow_url(),
        "MLFLOW_TRACKING_USERNAME": MLFLOW_CLIENT_USER,
        "MLFLOW_TRACKING_PASSWORD": mlflow_client_password(),
        # Fixed, not the caller's: `up` from another shell or interpreter (pyenv's shims rewrite PATH) must not look
        # like a changed environment and restart every running component.
        "PATH": f"{VENV / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    for conn_id, spec in render_connections().items():
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(spec, sort_keys=True)
    return env


def write_airflow_files() -> dict[str, str]:
    ensure_dir(P.airflow_home, owner=SERVICE_USER, mode=0o700)
    give_to_service_user(P.airflow_home)
    write_known_hosts(ensure_host_key())
    passwords = P.airflow_home / "passwords.json"
    if not passwords.exists():
        write_if_changed(passwords, json.dumps({"admin": secrets.token_urlsafe(12)}), mode=0o600, owner=SERVICE_USER)
    env = airflow_env()
    write_if_changed(STATE / "airflow-env.json", json.dumps(env, indent=2, sort_keys=True), mode=0o600)
    return env


def airflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    return run([str(VENV / "bin/airflow"), *args], cwd=REPO, **as_service_user(dict(os.environ, **env)))


def migrate_airflow_db() -> None:
    env = write_airflow_files()
    stamp = P.airflow_home / ".migrated"
    version = ",".join([METADATA_DB, *sorted(
        p.name for p in (VENV / "lib").glob("python3*/site-packages/apache_airflow-*.dist-info"))])
    if not stamp.exists() or stamp.read_text() != version:
        log("migrating the Airflow metadata DB")
        airflow("db", "migrate", env=env)
        stamp.write_text(version)
        chown(stamp, SERVICE_USER)
    # Pools keep a backfill from flooding the GPU partition or Spark; the DAGs name them.
    pools = REPO / "include/config/pools.json"
    pools_stamp = P.airflow_home / ".pools"
    digest = hashlib.sha256(pools.read_bytes() + METADATA_DB.encode()).hexdigest()
    if not pools_stamp.exists() or pools_stamp.read_text() != digest:
        log("importing Airflow pools from include/config/pools.json")
        airflow("pools", "import", str(pools), env=env)
        pools_stamp.write_text(digest)
        chown(pools_stamp, SERVICE_USER)


def start_airflow_component(component: str) -> int:
    env = dict(os.environ, **write_airflow_files())
    # The log server binds every interface and cannot be told otherwise; logs are read from the shared
    # local log folder instead, so it is not started.
    extra = ["--skip-serve-logs"] if component in ("scheduler", "triggerer") else []
    return spawn([str(VENV / "bin/airflow"), component, *extra], P.logs / f"airflow-{component}.log", env=env,
                 cwd=REPO, service_user=True)


def airflow_api_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['airflow_api_port']}/api/v2/monitor/health")


def airflow_health(component: str) -> dict:
    """The api-server's health entry of one component (status, last heartbeat); empty when it does not answer."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{STACK['airflow_api_port']}/api/v2/monitor/health", timeout=5
        ) as resp:
            return json.load(resp).get(component) or {}
    except (OSError, ValueError):
        return {}


def airflow_component_ready(component: str) -> Callable[[], bool]:
    def ready() -> bool:
        return airflow_health(component).get("status") == "healthy"

    return ready


# Airflow's components that heartbeat into the metadata DB, by their key in the api-server's health endpoint.
AIRFLOW_HEARTBEATS = {"airflow-scheduler": "scheduler", "airflow-triggerer": "triggerer",
                      "airflow-dag-processor": "dag_processor"}


def airflow_heartbeat(component: str) -> float:
    """When the component last heartbeat (epoch seconds), per the api-server; 0 when unknown."""
    beat = next((value for key, value in airflow_health(component).items() if key.startswith("latest_") and value),
                None)
    try:
        return datetime.fromisoformat(beat).timestamp() if beat else 0.0
    except ValueError:
        return 0.0


def restart_airflow_that_lost_its_database(components: list[Service], db_started_at: float,
                                            timeout_s: float = 600) -> None:
    """PostgreSQL was started again under running Airflow components: one that hit the outage shuts itself down
    (the scheduler first lets its running tasks finish), one that did not heartbeats on. Wait for each to do one
    or the other, and start the ones that exited: one `up` brings the whole control plane back."""
    for svc in components:
        deadline, told = time.monotonic() + timeout_s, False
        while svc.owned_pid() and airflow_heartbeat(AIRFLOW_HEARTBEATS[svc.name]) <= db_started_at:
            if time.monotonic() > deadline:
                log(f"{svc.name}: neither heartbeat nor exited {timeout_s:.0f} s after the database came back; "
                    f"restart it: localstack down {svc.name} && localstack up {svc.name}")
                break
            if not told:
                log(f"{svc.name}: waiting until it heartbeats on the restarted database or exits (it lets its "
                    "running tasks finish first)")
                told = True
            time.sleep(1)
        if not svc.owned_pid():
            log(f"{svc.name}: exited after losing its database; starting it")
            svc.pidfile.write_text(f"{svc.start()}\n")
            wait_for(svc.name, svc.ready, svc.timeout, svc.logfile)
            log(f"{svc.name}: ready")


def import_file_registry() -> None:
    """The suite's earlier file registry (models/<name>/registry.json) into MLflow, once: the module renames the
    file when done, so this is a check of one path on every later `up`."""
    found = sorted((P.storage / "models").glob("*/registry.json"))
    if not found:
        return
    log(f"importing {', '.join(map(str, found))} into the MLflow model registry (nightly.model_name's)")
    done = run([str(VENV / "bin/python"), "-m", "hybridflow.pipeline.registry", "import-json"], cwd=REPO, check=False,
               **as_service_user(dict(os.environ, **airflow_env())))
    if done.returncode != 0:
        sys.exit(f"importing the file registry failed (exit {done.returncode}): {done.stderr[-2000:]}; the stack is "
                 "up: fix what it says and run `make up` again (the import resumes without duplicates)")
    log(f"registry import: {done.stdout.strip()}")


def orphaned_executor_workers() -> list[int]:
    """Idle LocalExecutor workers of the service user whose scheduler is gone (reparented to PID 1)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        try:
            idle = cmdline.read_bytes().startswith(b"airflow worker -- LocalExecutor: <idle>")
            orphaned = idle and (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1] == "1"
        except OSError:
            continue
        if orphaned and proc_uid(pid) == pwd.getpwnam(SERVICE_USER).pw_uid:
            found.append(pid)
    return found


def reap_orphaned_executor_workers() -> int:
    """Kill idle LocalExecutor workers whose scheduler is gone (a SIGKILLed scheduler leaves its four behind,
    ~170 MB each, waiting forever on a queue nobody feeds). A worker still running a task is left to finish it."""
    reaped = 0
    for pid in orphaned_executor_workers():
        try:
            os.kill(pid, signal.SIGKILL)
            reaped += 1
        except ProcessLookupError:
            pass
    if reaped:
        log(f"killed {reaped} idle LocalExecutor worker(s) left behind by a scheduler that died")
    return reaped


def services() -> list[Service]:
    api = STACK["airflow_api_port"]
    return [
        Service("airflow-api-server", airflow_api_ready, lambda: start_airflow_component("api-server"),
                comm="airflow", endpoint=f"http://127.0.0.1:{api}", logfile=P.logs / "airflow-api-server.log",
                timeout=90),
        Service("airflow-scheduler", airflow_component_ready("scheduler"),
                lambda: start_airflow_component("scheduler"), comm="airflow",
                logfile=P.logs / "airflow-scheduler.log", timeout=90),
        Service("airflow-dag-processor", airflow_component_ready("dag_processor"),
                lambda: start_airflow_component("dag-processor"), comm="airflow",
                logfile=P.logs / "airflow-dag-processor.log", timeout=90),
        Service("airflow-triggerer", airflow_component_ready("triggerer"),
                lambda: start_airflow_component("triggerer"), comm="airflow",
                logfile=P.logs / "airflow-triggerer.log", timeout=90),
    ]
