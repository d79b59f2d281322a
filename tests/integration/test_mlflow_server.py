"""The stack's MLflow tracking server, reached as its clients reach it: basic auth (nothing anonymous), a
PostgreSQL backend, artifacts proxied to the S3 endpoint (the client holds no S3 keys), its secrets in 0600 files
and nowhere else, its own user, loopback only, and `status` and `down`/`up` as for every other service."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pgstack  # scripts/ is on the test path (pyproject.toml)
import pytest
import requests
from helpers.stack import localstack, s3_client, service_down

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state")).resolve()
SECRETS = STATE / "secrets"
PROFILE = json.loads((REPO / "include/profiles/local.json").read_text())["stack"]
MLFLOW_PYTHON = REPO / ".venv-mlflow/bin/python"
BUCKET = PROFILE["mlflow_artifacts_bucket"]
PASSWORD_FILES = ["mlflow-admin-password", "mlflow-airflow-password", "postgres-mlflow"]
API = "/api/2.0/mlflow"


@pytest.fixture(scope="module")
def mlflow(stack):
    conn = json.loads(stack["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    return SimpleNamespace(
        uri=stack["MLFLOW_TRACKING_URI"], auth=(stack["MLFLOW_TRACKING_USERNAME"], stack["MLFLOW_TRACKING_PASSWORD"]),
        admin=("admin", (SECRETS / "mlflow-admin-password").read_text().strip()), conn=conn,
    )


def call(mlflow, method: str, path: str, auth=None, **kw) -> requests.Response:
    return requests.request(method, f"{mlflow.uri}{path}", auth=auth, timeout=30, **kw)


def ok(response: requests.Response) -> dict:
    request = f"{response.request.method} {response.url}"
    assert response.status_code == 200, f"{request}: {response.status_code} {response.text}"
    return response.json() if response.content else {}


def server_pids() -> list[int]:
    """The server and every process of its session (the uvicorn worker): `down` stops that group."""
    leader = int((STATE / "run/mlflow.pid").read_text().split()[0])
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == leader:  # pgrp
                pids.append(int(entry.name))
    assert leader in pids
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_connection_and_the_airflow_environment_name_the_server(mlflow):
    conn = mlflow.conn
    assert conn["conn_type"] == "http"
    assert f"{conn['schema']}://{conn['host']}:{conn['port']}" == mlflow.uri == f"http://127.0.0.1:{PROFILE['mlflow_port']}"
    assert (conn["login"], conn["password"]) == mlflow.auth


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", f"{API}/experiments/search?max_results=1", None),
        ("POST", f"{API}/experiments/create", {"name": "anonymous"}),
        ("POST", f"{API}/runs/create", {"experiment_id": "0"}),
        ("POST", f"{API}/users/create", {"username": "intruder", "password": "a-long-enough-password"}),
        ("PUT", "/api/2.0/mlflow-artifacts/artifacts/0/anonymous.txt", None),
        ("GET", "/", None),
    ],
)
def test_anonymous_requests_are_refused(mlflow, method, path, body):
    response = call(mlflow, method, path, json=body)
    assert response.status_code == 401, response.text
    # Nor a wrong password for a real user.
    response = call(mlflow, method, path, auth=(mlflow.auth[0], "not-the-password"), json=body)
    assert response.status_code == 401, response.text


def test_health_needs_no_login(mlflow):
    assert call(mlflow, "GET", "/health").text == "OK"


def test_airflow_logs_in_as_an_ordinary_user(mlflow):
    assert ok(call(mlflow, "GET", f"{API}/users/current", auth=mlflow.auth))["user"]["is_admin"] is False
    assert ok(call(mlflow, "GET", f"{API}/users/current", auth=mlflow.admin))["user"]["is_admin"] is True
    refused = call(mlflow, "POST", f"{API}/users/create", auth=mlflow.auth,
                   json={"username": f"u{uuid.uuid4().hex[:8]}", "password": "a-long-enough-password"})
    assert refused.status_code == 403


def test_up_gives_the_users_their_generated_passwords_back(mlflow):
    """The auth store outlives .state (it is in PostgreSQL): after `make clean` the secrets are new, and MLflow
    reads the configured admin password only to create a missing admin. `up` re-keys both users."""
    try:
        for username in ("airflow", "admin"):  # the admin's own last: it signs both changes
            ok(call(mlflow, "PATCH", f"{API}/users/update-password", auth=mlflow.admin,
                    json={"username": username, "password": f"not-generated-{uuid.uuid4().hex}",
                          "current_password": mlflow.admin[1]}))
        assert call(mlflow, "GET", f"{API}/users/current", auth=mlflow.auth).status_code == 401
        assert call(mlflow, "GET", f"{API}/users/current", auth=mlflow.admin).status_code == 401
    finally:
        localstack("up", "mlflow")
    assert ok(call(mlflow, "GET", f"{API}/users/current", auth=mlflow.auth))["user"]["is_admin"] is False
    assert ok(call(mlflow, "GET", f"{API}/users/current", auth=mlflow.admin))["user"]["is_admin"] is True


def test_another_users_experiment_is_invisible_without_a_grant(mlflow):
    """default_permission = NO_PERMISSIONS: what the admin creates, Airflow's user may not even read."""
    name = f"test-admin-only-{uuid.uuid4().hex[:8]}"
    experiment_id = ok(call(mlflow, "POST", f"{API}/experiments/create", auth=mlflow.admin,
                            json={"name": name}))["experiment_id"]
    try:
        response = call(mlflow, "GET", f"{API}/experiments/get?experiment_id={experiment_id}", auth=mlflow.auth)
        assert response.status_code == 403
    finally:
        ok(call(mlflow, "POST", f"{API}/experiments/delete", auth=mlflow.admin, json={"experiment_id": experiment_id}))


@pytest.fixture
def experiment(mlflow):
    name = f"test-mlflow-server-{uuid.uuid4().hex[:8]}"
    experiment_id = ok(call(mlflow, "POST", f"{API}/experiments/create", auth=mlflow.auth,
                            json={"name": name}))["experiment_id"]
    yield SimpleNamespace(name=name, id=experiment_id)
    ok(call(mlflow, "POST", f"{API}/experiments/delete", auth=mlflow.auth, json={"experiment_id": experiment_id}))


def s3_key(artifact_uri: str, path: str) -> str:
    """Where the server puts a run's artifact: the bucket, then the run's mlflow-artifacts:/ path."""
    assert artifact_uri.startswith("mlflow-artifacts:/"), artifact_uri
    return f"{artifact_uri.removeprefix('mlflow-artifacts:/').strip('/')}/{path}"


def test_a_run_logs_params_metrics_and_an_artifact_through_the_server(mlflow, experiment, stack):
    run = ok(call(mlflow, "POST", f"{API}/runs/create", auth=mlflow.auth,
                  json={"experiment_id": experiment.id, "run_name": "rest", "start_time": 1}))["run"]["info"]
    run_id = run["run_id"]
    ok(call(mlflow, "POST", f"{API}/runs/log-parameter", auth=mlflow.auth,
            json={"run_id": run_id, "key": "learning_rate", "value": "0.02"}))
    ok(call(mlflow, "POST", f"{API}/runs/log-metric", auth=mlflow.auth,
            json={"run_id": run_id, "key": "auc", "value": 0.75, "timestamp": 2, "step": 3}))
    content = f"artifact of {run_id}\n".encode()
    url = f"/api/2.0/mlflow-artifacts/artifacts/{s3_key(run['artifact_uri'], 'report/hello.txt')}"
    ok(call(mlflow, "PUT", url, auth=mlflow.auth, data=content))
    ok(call(mlflow, "POST", f"{API}/runs/update", auth=mlflow.auth,
            json={"run_id": run_id, "status": "FINISHED", "end_time": 4}))

    read_back = call(mlflow, "GET", url, auth=mlflow.auth)
    assert read_back.status_code == 200 and read_back.content == content
    assert call(mlflow, "GET", url).status_code == 401  # artifacts are no more public than runs
    got = ok(call(mlflow, "GET", f"{API}/runs/get?run_id={run_id}", auth=mlflow.auth))["run"]
    assert {p["key"]: p["value"] for p in got["data"]["params"]} == {"learning_rate": "0.02"}
    assert [(m["key"], m["value"], m["step"]) for m in got["data"]["metrics"]] == [("auc", 0.75, 3)]
    assert got["info"]["status"] == "FINISHED"

    s3, _ = s3_client(stack)
    stored = s3.get_object(Bucket=BUCKET, Key=s3_key(run["artifact_uri"], "report/hello.txt"))
    assert stored["Body"].read() == content


def test_the_mlflow_client_needs_no_s3_keys(mlflow, experiment, stack, tmp_path):
    """MLflow's own client (its venv), with only the tracking URI and Airflow's MLflow login in its environment:
    the artifact goes up and comes back through the server, and lands in the bucket."""
    script = """
import json, sys
import mlflow
mlflow.set_experiment(experiment_id=sys.argv[1])
with mlflow.start_run(run_name="client") as run:
    mlflow.log_param("epochs", 3)
    mlflow.log_metric("loss", 0.5, step=1)
    mlflow.log_text("hello from the client\\n", "notes/hello.txt")
path = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="notes/hello.txt",
                                          dst_path=sys.argv[2])
print(json.dumps({"run_id": run.info.run_id, "artifact_uri": run.info.artifact_uri, "text": open(path).read()}))
"""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": mlflow.uri,
           "MLFLOW_TRACKING_USERNAME": mlflow.auth[0], "MLFLOW_TRACKING_PASSWORD": mlflow.auth[1]}
    done = subprocess.run([str(MLFLOW_PYTHON), "-c", script, experiment.id, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["text"] == "hello from the client\n"
    got = ok(call(mlflow, "GET", f"{API}/runs/get?run_id={result['run_id']}", auth=mlflow.auth))["run"]
    assert {p["key"]: p["value"] for p in got["data"]["params"]} == {"epochs": "3"}
    s3, _ = s3_client(stack)
    stored = s3.get_object(Bucket=BUCKET, Key=s3_key(result["artifact_uri"], "notes/hello.txt"))
    assert stored["Body"].read() == b"hello from the client\n"


def test_the_backend_store_is_the_stacks_postgresql(mlflow, stack):
    """Runs and users are rows in the `mlflow` database of this checkout's PostgreSQL (asked as its superuser)."""
    if stack["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite"):
        pytest.skip("the stack runs without PostgreSQL (HYBRIDFLOW_METADATA_DB=sqlite)")
    data_dir = Path(PROFILE["cluster_dir"]) / "postgres" / hashlib.sha256(str(STATE).encode()).hexdigest()[:12]
    info = pgstack.postmaster_info(data_dir)
    assert info, f"no PostgreSQL running on {data_dir}"
    out = pgstack.psql("SELECT username, is_admin FROM users ORDER BY username;", Path(info["socket_dir"]),
                       int(info["port"]), database="mlflow")
    assert out.split() == ["admin|t", "airflow|f"]


def test_passwords_are_in_0600_files_and_nowhere_else(mlflow):
    passwords = {}
    for name in PASSWORD_FILES:
        path = SECRETS / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == 0, name
        passwords[name] = path.read_text().strip()
        assert len(passwords[name]) >= 24
    mlflow_uid = pwd.getpwnam(PROFILE["mlflow_user"]).pw_uid
    for path in (STATE / "mlflow").iterdir():  # the server's own copies, for its user only
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == mlflow_uid, path
    assert stat.S_IMODE((STATE / "mlflow").stat().st_mode) == 0o700

    places = {"log": (STATE / "logs/mlflow.log").read_bytes()}
    for pid in server_pids():
        places[f"/proc/{pid}/cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes()
        places[f"/proc/{pid}/environ"] = Path(f"/proc/{pid}/environ").read_bytes()
    for name, password in passwords.items():
        for place, text in places.items():
            assert password.encode() not in text, f"{name} appears in {place}"
        # Tracked and untracked files of the checkout (.state and the venvs are git-ignored).
        found = subprocess.run(["git", "grep", "--untracked", "-F", "-l", "-e", password], cwd=REPO,
                               capture_output=True, text=True)
        assert found.returncode == 1 and not found.stdout, f"{name} appears in {found.stdout}"


def test_the_server_runs_as_its_own_user_on_loopback_only(mlflow):
    mlflow_uid = pwd.getpwnam(PROFILE["mlflow_user"]).pw_uid
    for pid in server_pids():
        assert Path(f"/proc/{pid}").stat().st_uid == mlflow_uid, pid
    port = f"{PROFILE['mlflow_port']:04X}"
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port}"):  # LISTEN
                listening.add(local.split(":")[0])
    assert listening == {"0100007F"}  # 127.0.0.1, nothing else


def test_status_shows_the_server(mlflow):
    done = subprocess.run([sys.executable, str(REPO / "scripts/localstack.py"), "status", "--json", "mlflow"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(done.stdout)
    assert row["service"] == "mlflow" and row["up"] is True
    assert row["pid"] == server_pids()[0] and row["endpoint"] == mlflow.uri
    assert row["log"].endswith("logs/mlflow.log")


def test_down_and_up_restart_it_with_its_runs_and_artifacts(mlflow, experiment):
    run = ok(call(mlflow, "POST", f"{API}/runs/create", auth=mlflow.auth,
                  json={"experiment_id": experiment.id}))["run"]["info"]
    url = f"/api/2.0/mlflow-artifacts/artifacts/{s3_key(run['artifact_uri'], 'kept.txt')}"
    ok(call(mlflow, "PUT", url, auth=mlflow.auth, data=b"kept"))
    before = server_pids()
    with service_down("mlflow"):
        assert not (STATE / "run/mlflow.pid").exists()
        assert not any(alive(pid) for pid in before)
        with pytest.raises(requests.ConnectionError):
            call(mlflow, "GET", "/health")
    assert server_pids()[0] != before[0]
    got = ok(call(mlflow, "GET", f"{API}/runs/get?run_id={run['run_id']}", auth=mlflow.auth))["run"]
    assert got["info"]["experiment_id"] == experiment.id
    assert call(mlflow, "GET", url, auth=mlflow.auth).content == b"kept"
