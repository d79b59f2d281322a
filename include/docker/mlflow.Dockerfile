# syntax=docker/dockerfile:1.7
# The MLflow tracking server of docker-compose.yaml, the local stack's pinned set (include/mlflow/requirements.txt:
# MLflow 3.17.2 with its basic-auth app, psycopg2, boto3); build context is the repository root.
FROM python:3.11-slim-bookworm

COPY include/mlflow/requirements.txt /opt/mlflow/requirements.txt
RUN pip install --no-cache-dir --no-deps -r /opt/mlflow/requirements.txt \
 && pip check

# The basic-auth config (no secrets in it: libpq takes the database password from PGPASSWORD, and mlflow-init
# creates the users) and the account tool the local stack uses too.
COPY include/mlflow/basic_auth.ini /opt/mlflow/basic_auth.ini
COPY scripts/mlflowstack.py /opt/mlflow/mlflowstack.py

RUN useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin mlflow
USER mlflow
WORKDIR /tmp
ENV MLFLOW_AUTH_CONFIG_PATH=/opt/mlflow/basic_auth.ini \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true \
    PYTHONUNBUFFERED=1
