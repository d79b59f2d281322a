"""The MLflow tracking server of the local stack (standard library only; scripts/stack/mlflow.py runs it).

    text = auth_ini(database_uri, admin_password)       # the basic-auth app's config (MLFLOW_AUTH_CONFIG_PATH)
    text = aws_credentials(access_key, secret_key)      # the server's S3 keys (AWS_SHARED_CREDENTIALS_FILE)
    cmd = server_command(mlflow, port, backend_uri, destination, workers)
    env = server_env(home, files, s3_endpoint, flask_secret)
    authenticates(url, (user, password))                # does the server take this login?

The server runs `--app-name basic-auth`: every request but /health and static files needs a user, and a new
user may read or write nothing until granted (`default_permission = NO_PERMISSIONS`) except what it creates. It
proxies artifacts (`--serve-artifacts`) to the S3 destination, so clients need no S3 keys; only the server holds
them. Passwords reach it in files only (the auth config, a libpq password file), never on its command line or in
its environment.

Also a command, run in MLflow's venv (or image) as the server's user: by the local stack, and by docker-compose's
one-shot mlflow-init:

    python mlflowstack.py ensure-accounts   # the admin from the auth config, MLFLOW_USER_{NAME,PASSWORD} (env)
                                            # as an ordinary user: created or re-keyed in the auth store
    python mlflowstack.py ensure-bucket s3://bucket/prefix    # boto3 with the server's keys and endpoint
"""

from __future__ import annotations

import base64
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "3.17.2"  # include/mlflow/requirements.txt pins it; 3.18.0 is not installable (shared/notes)
ADMIN_USERNAME = "admin"
HOST = "127.0.0.1"
MIN_PASSWORD_LENGTH = 12  # MLflow's own rule (mlflow.utils.validation._validate_password)


# ---------------------------------------------------------------------------------------------- pure builders
def _ini_value(value: str) -> str:
    """A value for MLflow's configparser.ConfigParser: one line, '%' doubled (its interpolation syntax)."""
    if "\n" in value or "\r" in value:
        raise ValueError("a line break cannot be written to the auth config")
    if value != value.strip():
        raise ValueError("configparser strips surrounding whitespace: not a faithful value")
    return value.replace("%", "%%")


def auth_ini(database_uri: str, admin_password: str, admin_username: str = ADMIN_USERNAME) -> str:
    """The basic-auth app's config. Nobody may do anything unauthenticated, and an authenticated user nothing
    it was not granted (NO_PERMISSIONS) beyond what it creates. The admin is created with `admin_password` at the
    first start against an empty user store (a later change of the file does not re-key it)."""
    if len(admin_password) < MIN_PASSWORD_LENGTH:
        raise ValueError(f"MLflow refuses passwords shorter than {MIN_PASSWORD_LENGTH} characters")
    return f"""\
# Written by scripts/localstack.py at every `make up` (scripts/mlflowstack.py); holds the admin password: 0600.
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = {_ini_value(database_uri)}
admin_username = {_ini_value(admin_username)}
admin_password = {_ini_value(admin_password)}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
# A password check costs ~0.3 s of CPU (a deliberately slow hash): every request of a run's logging would pay it.
# A login that passed is trusted for 60 s per worker; a password changed over the API is dropped at once.
auth_cache_ttl_seconds = 60
"""


def aws_credentials(access_key: str, secret_key: str) -> str:
    """boto3's shared credentials file: the S3 keys reach the server in a file, not its environment."""
    for value in (access_key, secret_key):
        if not value or any(c in value for c in "\r\n[]") or value != value.strip():
            raise ValueError("unsupported character in an S3 key")
    return f"[default]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n"


def server_command(mlflow: Path, port: int, backend_uri: str, artifacts_destination: str, workers: int = 1,
                   host: str = HOST) -> list[str]:
    """`mlflow server` with authentication, proxied artifacts and the stores; nothing secret in it (the backend
    URI carries no password: libpq reads it from PGPASSFILE)."""
    if urllib.parse.urlsplit(backend_uri).password is not None:
        raise ValueError("the backend store URI must not carry a password (command lines are public)")
    if not artifacts_destination.startswith("s3://"):
        raise ValueError(f"artifacts go to an S3 bucket, not {artifacts_destination!r}")
    return [str(mlflow), "server", "--app-name", "basic-auth",
            "--backend-store-uri", backend_uri, "--serve-artifacts", "--artifacts-destination", artifacts_destination,
            "--host", host, "--port", str(int(port)), "--workers", str(int(workers))]


def server_env(home: Path, auth_config: Path, pgpass: Path, aws_credentials_file: Path, s3_endpoint: str,
               flask_secret_key: str, path: str) -> dict[str, str]:
    """The server's whole environment (not the caller's, which may hold other services' secrets)."""
    return {
        "PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_config),
        "PGPASSFILE": str(pgpass),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws_credentials_file),
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_DEFAULT_REGION": "us-east-1",
        "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
        # The basic-auth app's CSRF key: the same in every worker (env only: MLflow reads it from nowhere else).
        "MLFLOW_FLASK_SERVER_SECRET_KEY": flask_secret_key,
        # Job execution (LLM judges, scorers) starts a huey consumer per server: nothing here uses it.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        # No telemetry from a loopback server (and no waiting on a network that is not there).
        "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
        "PYTHONUNBUFFERED": "1",
    }


def basic_auth(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


# ---------------------------------------------------------------------------------------------- accounts
def authenticates(base_url: str, auth: tuple[str, str], timeout: float = 30) -> bool:
    """Does the server accept this user and password?"""
    req = urllib.request.Request(base_url.rstrip("/") + "/api/2.0/mlflow/users/current",
                                 headers={"Authorization": basic_auth(*auth)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return False
        raise RuntimeError(f"MLflow at {base_url} answered {exc.code} to a login check") from exc


def ensure_accounts(username: str, password: str) -> list[str]:
    """In the auth store (MLFLOW_AUTH_CONFIG_PATH's database_uri; run in MLflow's venv as the server's user): the
    configured admin with the configured password, and `username` as an ordinary user with `password`; each
    created or corrected, the server running or not. MLflow itself reads `admin_password` only to create a missing
    admin, so after `make clean` (new secrets, the store in PostgreSQL kept) this is what re-keys it. One line per
    change (never a password)."""
    from mlflow.server.auth.config import read_auth_config  # MLflow's venv only
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    config = read_auth_config()
    if not config.admin_password:
        raise RuntimeError("the auth config names no admin_password (nor MLFLOW_AUTH_ADMIN_PASSWORD)")
    store = SqlAlchemyStore()
    store.init_db(config.database_uri)
    changes = []
    for name, secret, admin in ((config.admin_username, config.admin_password, True), (username, password, False)):
        if not store.has_user(name, use_primary=True):
            store.create_user(name, secret, is_admin=admin)
            changes.append(f"user {name} created" + (" (admin)" if admin else ""))
        elif (not store.authenticate_user(name, secret, use_primary=True)
              or store.get_user(name).is_admin != admin):
            store.update_user(name, password=secret, is_admin=admin)
            changes.append(f"user {name} re-keyed from the configured password" + (" (admin)" if admin else ""))
    return changes


def ensure_bucket(destination: str) -> str:
    """Create the destination's bucket when missing (boto3: run in MLflow's venv, with the server's keys and
    MLFLOW_S3_ENDPOINT_URL). "exists" or "created"."""
    import boto3  # MLflow's venv only
    from botocore.exceptions import ClientError

    bucket = urllib.parse.urlsplit(destination).netloc
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    try:
        s3.head_bucket(Bucket=bucket)
        return "exists"
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    s3.create_bucket(Bucket=bucket)
    return "created"


def main(argv: list[str]) -> int:
    if argv[:1] == ["ensure-accounts"]:
        for change in ensure_accounts(os.environ["MLFLOW_USER_NAME"], os.environ["MLFLOW_USER_PASSWORD"]):
            print(change)
        return 0
    if argv[:1] == ["ensure-bucket"] and len(argv) == 2:
        print(ensure_bucket(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
