"""Shared fixtures. Integration tests use the real local stack brought up by scripts/localstack.py.

pytest's config (pyproject.toml) puts jobs/, scripts/ and tests/ on the path: the jobs' packages, the REST client
shared with `make demo` (airflow_api), and the helpers the test modules share (tests/helpers/).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest
from helpers.dag_runs import runner_argv, write_dag_file
from helpers.stack import LOCALSTACK
from helpers.triton_models import ClientLoop

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state"))
# Spark drivers the tests start in their own process bind loopback, like the stack's (no port on the network).
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# The tests run as root beside Airflow's unprivileged service user: what they write into the shared storage must
# stay writable by the storage group (as everything the stack and the Slurm jobs write), so a task may replace it.
os.umask(0o002)


def stack_environment() -> dict[str, str]:
    """The environment `make up` wrote for Airflow: AIRFLOW_HOME, AIRFLOW_CONN_* and HYBRIDFLOW_*."""
    path = STATE / "airflow-env.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make up` (the README's test command does it for you)")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def stack(request) -> dict[str, str]:
    """Brings every service of the local stack up once per session (a no-op when `make up` already did). Not in
    a lane of scripts/test_lanes.py (HYBRIDFLOW_STACK_UP_BY_LANES): it brought the stack up before the lanes
    started, and a lane's up could restart a service another lane's test took down on purpose."""
    if not os.environ.get("HYBRIDFLOW_STACK_UP_BY_LANES"):
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


@pytest.fixture
def default_deployment(monkeypatch):
    """The pipeline config as without the stack's environment: HYBRIDFLOW_DEPLOYMENT unset (job keys say
    'default'), the cached config read again before and after."""
    from hybridflow.config import pipeline_config

    monkeypatch.delenv("HYBRIDFLOW_DEPLOYMENT", raising=False)
    pipeline_config.cache_clear()
    yield
    pipeline_config.cache_clear()


@pytest.fixture
def empty_model_registry(monkeypatch):
    """For tests without the stack that plan a nightly run: the MLflow registry (a server process, the boundary
    here) stands in as one with no champion yet; the registry itself is tested against the real server
    (tests/integration/test_model_registry.py)."""
    from types import SimpleNamespace

    from hybridflow.pipeline import nightly_tasks

    monkeypatch.setattr(nightly_tasks, "model_registry", lambda config: SimpleNamespace(champion=lambda: None))


@pytest.fixture
def cluster_tmp_path(stack):
    """A temporary folder in the shared storage's scratch area, for jobs whose executors run as the stack's
    service user (Spark standalone): pytest's own tmp_path lies under a folder only root may enter."""
    import shutil

    root = Path(stack.get("HYBRIDFLOW_STORAGE_ROOT", "/var/lib/hybridflow/storage")) / "scratch" / "tests"
    path = root / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)  # setgid storage group, group-writable under the tests' umask 002
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               # Its Slurm jobs are its own: the stack's orphan reconciler leaves them alone, and the other way round
               # (its session's folder in the name: test lanes running side by side are told apart too).
               HYBRIDFLOW_DEPLOYMENT=f"pytest-{home.parent.name}-{home.name}")
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env, check=True,
                   capture_output=True)
    return env


@pytest.fixture
def run_dag(isolated_airflow_env):
    """Write a DAG file and run its DAG once through Airflow's real task lifecycle (dag.test, triggers inline)."""

    def run(source: str, dag_id: str, conf: dict | None = None, timeout_s: float = 600, logical_date: str = "",
            background: bool = False, output: Path | None = None):
        argv = runner_argv(write_dag_file(isolated_airflow_env, source, dag_id), dag_id, conf, logical_date)
        if background:  # the caller kills it: a task process dying mid-wait; its log goes to `output` if given
            with open(output or os.devnull, "wb") as sink:
                return subprocess.Popen(argv, env=isolated_airflow_env, stdout=sink, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        out = subprocess.run(argv, env=isolated_airflow_env, capture_output=True, text=True, timeout=timeout_s)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            pytest.fail(
                f"DAG run produced no result (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        result["log"] = out.stdout + out.stderr
        return result

    return run


class TaskInstanceWatch:
    """Reads a task instance's row in the metadata DB of run_dag's Airflow home (SQLite) to wait for the moment a
    test injects a fault in, instead of sleeping and hoping."""

    # deferred: the execution API recorded its trigger and resume method (dag.test runs the trigger inline and
    # flips the state to queued meanwhile; trigger and method stay recorded). polling: running execute() itself.
    MOMENTS = {
        "deferred": lambda row: bool(row and row["state"] in ("deferred", "queued") and row["next_method"]
                                     and row["trigger_id"]),
        "polling": lambda row: bool(row and row["state"] == "running" and not row["next_method"]),
    }

    def __init__(self, airflow_env: dict[str, str]):
        url = airflow_env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert url.startswith("sqlite:///"), url
        self.db_path = url[len("sqlite:///"):]

    def row(self, dag_id: str, task_id: str = "job") -> dict | None:
        """(state, next_method, trigger_id) of the latest try, or None before the run exists or while the writer
        holds the lock."""
        try:
            with closing(sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=5)) as db:
                row = db.execute("SELECT state, next_method, trigger_id FROM task_instance WHERE dag_id = ? AND "
                                 "task_id = ? ORDER BY try_number DESC LIMIT 1", (dag_id, task_id)).fetchone()
        except sqlite3.OperationalError:  # locked by the task's own process, or not migrated yet: ask again
            return None
        return dict(zip(("state", "next_method", "trigger_id"), row, strict=True)) if row else None

    def wait(self, dag_id: str, moment: str, task_id: str = "job", timeout_s: float = 60) -> dict:
        reached = self.MOMENTS[moment]
        seen: list[dict | None] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = self.row(dag_id, task_id)
            if not seen or row != seen[-1]:
                seen.append(row)
            if reached(row):
                return row
            time.sleep(0.2)
        pytest.fail(f"task {task_id} of {dag_id} was not {moment} within {timeout_s:.0f} s; its task instance went "
                    f"through {seen} (state, next_method, trigger_id)", pytrace=False)


@pytest.fixture
def task_watch(isolated_airflow_env) -> TaskInstanceWatch:
    return TaskInstanceWatch(isolated_airflow_env)


def slurm_jobs_named(fragment: str) -> list[str]:
    """Every Slurm job id whose name holds ``fragment``, in the queue or in accounting (the last day), in
    numeric order: the oracle for "no second sbatch"."""
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook()
    try:
        sacct = hook.run(["sacct", "-X", "-P", "-n", "--starttime=now-1days", "--format=JobID,JobName"]).stdout
        squeue = hook.run(["squeue", "--states=all", "--noheader", "-o", "%i|%j"]).stdout
    finally:
        hook.close()
    return sorted({line.split("|")[0] for line in (sacct + squeue).splitlines() if fragment in line}, key=int)


@pytest.fixture
def jobs_named(stack):
    return slurm_jobs_named


@pytest.fixture
def log_dir(stack):
    """A folder for Slurm job logs in the shared storage's runs area, removed (over SSH, as the job user) after."""
    from hybridflow.hooks.slurm import SlurmHook

    path = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/tests-{uuid.uuid4().hex[:8]}"
    yield path
    hook = SlurmHook()
    try:
        hook.run(["rm", "-rf", "--", path])
    finally:
        hook.close()


@pytest.fixture
def slurm(stack):
    """The project's SlurmHook on the stack's login node (its SSH connection closed afterwards)."""
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook()
    yield hook
    hook.close()


@pytest.fixture(scope="session")
def model_of_record(stack) -> dict:
    """The stack's model of record (what scoring and the realtime route use): the champion a nightly run left,
    or, on a stack that has none yet, a small untrained network of the features contract exported by the
    training job's own export code and promoted as one (run_id ``tests-model-of-record``). A test that scores or
    deploys so never depends on which test ran first."""
    import numpy as np
    import torch
    from hybridflow.config import pipeline_config
    from hybridflow.layout import EXPORT_FILES
    from hybridflow.pipeline.nightly_tasks import model_of_record as current
    from hybridflow.pipeline.nightly_tasks import model_registry
    from hybridjobs.features import FEATURE_COLUMNS
    from hybridtrain.config import ModelSpec
    from hybridtrain.export import SMOKE_ROWS, export_model
    from hybridtrain.model import build_network

    config = pipeline_config()
    registry = model_registry(config)
    if registry.champion() is None:
        torch.manual_seed(0)
        spec = ModelSpec(hidden_sizes=(16,), dropout=0.0)
        n = len(FEATURE_COLUMNS)
        export_dir = Path(config.storage.root) / "runs" / "tests-model-of-record" / "export"
        export_model(build_network(n, spec).state_dict(), spec=spec, mean=np.zeros(n, np.float32),
                     std=np.ones(n, np.float32), feature_columns=tuple(FEATURE_COLUMNS),
                     smoke_inputs=np.random.default_rng(0).normal(size=(SMOKE_ROWS, n)).astype(np.float32),
                     export_dir=export_dir, details={"step": 0, "run_id": "tests-model-of-record"})
        mlflow = registry.mlflow  # its MLflow run, as a training task leaves one: the version's source
        run = mlflow.create_run(mlflow.experiment_id("tests"), "tests-model-of-record", {}, int(time.time() * 1000))
        for name in EXPORT_FILES:
            mlflow.upload_artifact(run["info"]["artifact_uri"], f"model/{name}", (export_dir / name).read_bytes())
        mlflow.finish_run(run["info"]["run_id"], "FINISHED", int(time.time() * 1000))
        version = registry.register(str(export_dir), run_id=run["info"]["run_id"], details={
            "airflow_run_id": "tests-model-of-record", "decision": "first_model",
            "reason": "tests: no model of record on this stack yet"})
        registry.promote(version["version"], expected_champion=None, reason="tests: no model of record yet")
    return current(config)


@pytest.fixture
def repository(stack) -> str:
    """The stack's Triton model repository: a folder of the shared storage, the server's --model-repository."""
    return f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/model-repository"


@pytest.fixture
def client_loop(stack, tmp_path):
    """Starts a helpers.triton_models.ClientLoop asking the stack's Triton for a model (keyword arguments go to it:
    retry_s, network_timeout_s); every loop still running is killed when the test ends."""
    loops: list[ClientLoop] = []

    def start(name: str, **options) -> ClientLoop:
        loops.append(ClientLoop(name, tmp_path / f"client-{len(loops)}.json", **options))
        return loops[-1]

    yield start
    for loop in loops:
        if loop.proc.poll() is None:
            loop.proc.kill()


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible endpoint of this module's own: moto's server (the one that runs here; shared/notes) in this
    process, on a free port. Its URL."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
