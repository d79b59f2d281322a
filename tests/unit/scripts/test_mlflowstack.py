"""scripts/mlflowstack.py's pure parts: the basic-auth config, the S3 credentials file, the server's command line
and environment, as MLflow and boto3 will read them."""

from __future__ import annotations

import configparser
from pathlib import Path

import mlflowstack  # pytest puts scripts/ on sys.path (pythonpath in pyproject.toml)
import pytest

PG_URI = "postgresql+psycopg2://mlflow@127.0.0.1:5433/mlflow"
PASSWORD = "Zx9-generated_password-0123456789"


def read_ini(text: str) -> configparser.SectionProxy:
    """As MLflow reads it (mlflow.server.auth.config: a plain ConfigParser, so with '%' interpolation)."""
    config = configparser.ConfigParser()
    config.read_string(text)
    return config["mlflow"]


def test_auth_ini_lets_nobody_do_anything_ungranted():
    section = read_ini(mlflowstack.auth_ini(PG_URI, PASSWORD))
    assert section["default_permission"] == "NO_PERMISSIONS"
    assert section["database_uri"] == PG_URI
    assert section["admin_username"] == "admin" and section["admin_password"] == PASSWORD
    assert section["authorization_function"] == "mlflow.server.auth:authenticate_request_basic_auth"
    assert section.getboolean("grant_default_workspace_access") is False
    assert section.getint("auth_cache_ttl_seconds") == 60  # not a slow password hash per logged metric


@pytest.mark.parametrize("password", ["with%percent-sign-01", "%(admin_username)s-is-not-expanded", "a%%b-long-enough"])
def test_auth_ini_values_read_back_unchanged(password):
    uri = "postgresql+psycopg2://mlflow@127.0.0.1:5433/ml%20flow"
    section = read_ini(mlflowstack.auth_ini(uri, password))
    assert section["admin_password"] == password and section["database_uri"] == uri


@pytest.mark.parametrize("password", ["short", "line\nbreak-long-enough", " padded-long-enough "])
def test_auth_ini_refuses_what_mlflow_or_configparser_would_not_keep(password):
    with pytest.raises(ValueError):
        mlflowstack.auth_ini(PG_URI, password)


def test_aws_credentials_read_back_as_botocore_reads_them():
    config = configparser.RawConfigParser()
    config.read_string(mlflowstack.aws_credentials("AKIA0123", "se/cr+et%=key"))
    assert dict(config["default"]) == {"aws_access_key_id": "AKIA0123", "aws_secret_access_key": "se/cr+et%=key"}


@pytest.mark.parametrize("access, secret", [("", "x"), ("a\nb", "x"), ("a", "[default]"), ("a", " x")])
def test_aws_credentials_refuse_odd_keys(access, secret):
    with pytest.raises(ValueError):
        mlflowstack.aws_credentials(access, secret)


def test_server_command():
    assert mlflowstack.server_command(Path("/v/bin/mlflow"), 5000, PG_URI, "s3://hybridflow-mlflow", 2) == [
        "/v/bin/mlflow", "server", "--app-name", "basic-auth",
        "--backend-store-uri", PG_URI, "--serve-artifacts", "--artifacts-destination", "s3://hybridflow-mlflow",
        "--host", "127.0.0.1", "--port", "5000", "--workers", "2",
    ]


def test_server_command_refuses_a_password_in_the_backend_uri():
    with pytest.raises(ValueError, match="password"):
        mlflowstack.server_command(Path("/v/bin/mlflow"), 5000, "postgresql://mlflow:pw@127.0.0.1/mlflow", "s3://b")


@pytest.mark.parametrize("destination", ["/tmp/mlartifacts", "file:///tmp/a", "mlflow-artifacts:/"])
def test_server_command_sends_artifacts_to_s3_only(destination):
    with pytest.raises(ValueError, match="S3"):
        mlflowstack.server_command(Path("/v/bin/mlflow"), 5000, PG_URI, destination)


def test_server_env_holds_paths_to_secrets_not_secrets():
    folder = Path("/s/mlflow")
    env = mlflowstack.server_env(folder, folder / "auth.ini", folder / "pgpass", folder / "aws-credentials",
                                 "http://127.0.0.1:9000", "csrf-key", "/v/bin:/usr/bin")
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == "/s/mlflow/auth.ini"
    assert env["PGPASSFILE"] == "/s/mlflow/pgpass"
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/s/mlflow/aws-credentials"
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == "csrf-key"
    assert env["HOME"] == "/s/mlflow" and env["PATH"] == "/v/bin:/usr/bin"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert not {key for key in env if "PASSWORD" in key or key.startswith("AWS_ACCESS") or key.startswith("AWS_SECRET")}


def test_basic_auth_header():
    assert mlflowstack.basic_auth("airflow", "p:w") == "Basic YWlyZmxvdzpwOnc="
