"""This checkout's PostgreSQL (scripts/pgstack.py): Airflow's metadata database and MLflow's stores."""

from __future__ import annotations

import pgstack

from .common import (
    METADATA_DB,
    STACK,
    P,
    Service,
    log,
)

MLFLOW_LOGIN = pgstack.Login("mlflow", "mlflow", "postgres-mlflow")  # its role and database in PostgreSQL
# Every ensure_cluster call names the same logins: pg_hba.conf admits only those.
POSTGRES_MORE_LOGINS = [MLFLOW_LOGIN]


def postgres_port() -> int:
    return int(STACK.get("postgres_port", 5433))


def postgres_ready() -> bool:
    # This checkout's server, not another clone's on the same port (whose role would refuse our password).
    return pgstack.postmaster_pid(P.postgres) is not None and pgstack.ready(postgres_port())


def start_postgres() -> int:
    pgstack.ensure_cluster(P.postgres, postgres_port(), P.local_secrets, log, POSTGRES_MORE_LOGINS)
    return pgstack.start(P.postgres, postgres_port(), P.logs / "postgres.log")


def metadata_db_url() -> str:
    if METADATA_DB == "sqlite":
        return f"sqlite:///{P.airflow_home / 'airflow.db'}"
    return pgstack.sqlalchemy_url(pgstack.ensure_password(P.local_secrets), postgres_port())


def services() -> list[Service]:
    """None (an empty list) when Airflow's metadata database is SQLite."""
    if METADATA_DB != "postgres":
        return []
    return [Service("postgres", postgres_ready, start_postgres, comm="postgres",
                    endpoint=f"127.0.0.1:{postgres_port()}", logfile=P.logs / "postgres.log")]
