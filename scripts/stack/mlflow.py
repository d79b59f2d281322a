"""The MLflow tracking server (scripts/mlflowstack.py), run from its own venv as its own user."""

from __future__ import annotations

import hashlib
import json
import pwd
from pathlib import Path

import mlflowstack
import pgstack

from .common import (
    METADATA_DB,
    MLFLOW_VENV,
    REPO,
    STACK,
    STATE,
    P,
    Service,
    as_user,
    ensure_dir,
    http_ok,
    log,
    run,
    secret,
    spawn,
    wait_for,
    write_if_changed,
)
from .postgres import MLFLOW_LOGIN, POSTGRES_MORE_LOGINS, postgres_port
from .s3 import s3_ready
from .system import ensure_checkout_reachable

# The MLflow server runs as a user of its own: Airflow's tasks (the service user) cannot read its auth store, its
# admin password or its database password; Airflow logs in to it as an ordinary MLflow user.
MLFLOW_USER = STACK.get("mlflow_user", "mlflow")
MLFLOW_CLIENT_USER = "airflow"


def ensure_mlflow_user() -> None:
    """The MLflow server's own system user (no login, no home of its own: it lives in .state/mlflow)."""
    try:
        pwd.getpwnam(MLFLOW_USER)
    except KeyError:
        log(f"creating the MLflow server's user {MLFLOW_USER}")
        run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
             "/usr/sbin/nologin", MLFLOW_USER])


def mlflow_port() -> int:
    return int(STACK.get("mlflow_port", 5000))


def mlflow_url() -> str:
    return f"http://127.0.0.1:{mlflow_port()}"


def mlflow_artifacts_destination() -> str:
    return f"s3://{STACK.get('mlflow_artifacts_bucket', 'hybridflow-mlflow')}"


def mlflow_store_uris() -> tuple[str, str]:
    """(tracking and registry store, auth store): the database and role `mlflow` in this checkout's PostgreSQL,
    the password in a libpq password file (the auth tables keep their own alembic version table beside the
    tracking tables); SQLite files in the server's folder when the stack runs without PostgreSQL."""
    if METADATA_DB == "sqlite":
        return f"sqlite:///{P.mlflow / 'mlflow.db'}", f"sqlite:///{P.mlflow / 'auth.db'}"
    uri = f"postgresql+psycopg2://{MLFLOW_LOGIN.role}@127.0.0.1:{postgres_port()}/{MLFLOW_LOGIN.database}"
    return uri, uri


def mlflow_admin() -> tuple[str, str]:
    return mlflowstack.ADMIN_USERNAME, secret("mlflow-admin-password", P.local_secrets)


def mlflow_client_password() -> str:
    """Airflow's MLflow password (the `airflow` MLflow user, no admin)."""
    return secret("mlflow-airflow-password", P.local_secrets)


def mlflow_files() -> dict[Path, str]:
    """The server's own files (0600, its user's) and their text, rendered from the generated secrets in
    .state/secrets: the auth config, the S3 credentials and (with PostgreSQL) the libpq password file."""
    files = {
        P.mlflow / "auth.ini": mlflowstack.auth_ini(mlflow_store_uris()[1], mlflow_admin()[1]),
        P.mlflow / "aws-credentials": mlflowstack.aws_credentials(secret("s3-access-key", P.local_secrets, 12),
                                                                  secret("s3-secret-key", P.local_secrets)),
    }
    if METADATA_DB == "postgres":
        db_password = pgstack.ensure_password(P.local_secrets, name=MLFLOW_LOGIN.password_file)
        files[P.mlflow / "pgpass"] = pgstack.pgpass_line(db_password, postgres_port(), MLFLOW_LOGIN.role,
                                                         MLFLOW_LOGIN.database)
    return files


def mlflow_server_env() -> dict[str, str]:
    return mlflowstack.server_env(
        home=P.mlflow, auth_config=P.mlflow / "auth.ini", pgpass=P.mlflow / "pgpass",
        aws_credentials_file=P.mlflow / "aws-credentials", s3_endpoint=f"http://127.0.0.1:{STACK['s3_port']}",
        flask_secret_key=secret("mlflow-flask-secret-key", P.local_secrets, 32),
        path=f"{MLFLOW_VENV / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
    )


def mlflow_command() -> list[str]:
    return mlflowstack.server_command(MLFLOW_VENV / "bin/mlflow", mlflow_port(), mlflow_store_uris()[0],
                                      mlflow_artifacts_destination(), int(STACK.get("mlflow_workers", 1)))


def mlflow_config_digest() -> str:
    """What a server is started with (command, environment, files): `up` restarts a running one when it changed."""
    config = [mlflow_command(), mlflow_server_env(), {str(path): text for path, text in mlflow_files().items()}]
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def write_mlflow_files() -> dict[str, str]:
    """The server's folder (its user's, 0700, reached through .state by a traverse-only ACL entry) and files;
    returns the server's environment."""
    ensure_dir(P.mlflow, owner=MLFLOW_USER, mode=0o700)
    run(["setfacl", "-m", f"u:{MLFLOW_USER}:x", str(STATE)])
    for path, text in mlflow_files().items():
        write_if_changed(path, text, 0o600, MLFLOW_USER)
    return mlflow_server_env()


def mlflow_venv_run(*args: str, env: dict) -> str:
    """scripts/mlflowstack.py in MLflow's venv, as its user, with the server's environment; its output."""
    return run([str(MLFLOW_VENV / "bin/python"), str(REPO / "scripts/mlflowstack.py"), *args], cwd=P.mlflow,
               **as_user(MLFLOW_USER, env, home=P.mlflow)).stdout.strip()


def ensure_mlflow_bucket(env: dict) -> None:
    """The artifact bucket, after the S3 endpoint or MLflow (re)started: moto keeps buckets in memory."""
    wait_for("s3 (MLflow's artifact store)", s3_ready, 60, P.logs / "s3.log")
    if mlflow_venv_run("ensure-bucket", mlflow_artifacts_destination(), env=env) == "created":
        log(f"mlflow: created the artifact bucket {mlflow_artifacts_destination()}")


def start_mlflow() -> int:
    if not (MLFLOW_VENV / "bin/mlflow").exists():
        raise RuntimeError(f"no MLflow venv at {MLFLOW_VENV}: run `make venv` (or `make up`) first")
    ensure_mlflow_user()
    ensure_checkout_reachable(MLFLOW_USER, MLFLOW_VENV, REPO / "scripts")
    if METADATA_DB == "postgres":
        # Its role and database, also in a cluster that an older version created (the server is up: cmd_up).
        pgstack.ensure_cluster(P.postgres, postgres_port(), P.local_secrets, log, POSTGRES_MORE_LOGINS)
    env = write_mlflow_files()
    # Its bucket is made once the S3 endpoint is up (cmd_up): the server needs it only for artifact requests.
    return spawn(mlflow_command(), P.logs / "mlflow.log", cwd=P.mlflow,
                 identity=as_user(MLFLOW_USER, env, home=P.mlflow))


def mlflow_ready() -> bool:
    return http_ok(f"{mlflow_url()}/health")


def ensure_mlflow_accounts() -> None:
    """The admin logs in with the password in .state/secrets, and Airflow's ordinary user with its own; the auth
    store is corrected when either does not (the first start, or the store kept in PostgreSQL by `make clean`)."""
    client = (MLFLOW_CLIENT_USER, mlflow_client_password())
    if all(mlflowstack.authenticates(mlflow_url(), login) for login in (mlflow_admin(), client)):
        return
    env = dict(write_mlflow_files(), MLFLOW_USER_NAME=client[0], MLFLOW_USER_PASSWORD=client[1])
    for change in mlflow_venv_run("ensure-accounts", env=env).splitlines():
        log(f"mlflow: {change}")


def services() -> list[Service]:
    return [Service("mlflow", mlflow_ready, start_mlflow, comm="mlflow", endpoint=mlflow_url(),
                    logfile=P.logs / "mlflow.log", timeout=90)]
