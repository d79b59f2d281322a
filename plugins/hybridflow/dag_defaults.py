"""Defaults every DAG of the suite shares: owner, retries, the on-call failure alert. DAG files stay wiring only."""

from __future__ import annotations

from datetime import timedelta

from hybridflow.config import pipeline_config
from hybridflow.notifiers.oncall import OnCallNotifier

OWNER = "ml-platform"


def failure_alert(stage: str | None = None) -> OnCallNotifier:
    """The on-call notifier configured by pipeline.yaml's ``alerts``; ``stage`` names tasks outside a stage
    task group (e.g. "router")."""
    alerts = pipeline_config().alerts
    return OnCallNotifier(sink_conn_id=alerts.sink_conn_id or None, dedup_window_s=alerts.dedup_window_s,
                          log_lines=alerts.log_lines, stage=stage)


def run_deadline(seconds: float):
    """A run not done ``seconds`` after it was queued alerts on-call with the stage it is in (kind ``late``, the
    failure alert's sinks; see hybridflow/notifiers/deadline.py). Queued, not the data interval: a manual run or
    a backfill started late gets the same time as a scheduled night."""
    from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

    from hybridflow.notifiers.deadline import missed_deadline

    alerts = pipeline_config().alerts
    return DeadlineAlert(reference=DeadlineReference.DAGRUN_QUEUED_AT, interval=timedelta(seconds=seconds),
                         callback=AsyncCallback(missed_deadline, kwargs={
                             "deadline_s": seconds, "sink_conn_id": alerts.sink_conn_id,
                             "dedup_window_s": alerts.dedup_window_s}))


# Hadoop's own umask (not the process's) sets what Spark writes: 002, shared storage stays group-writable.
SPARK_CONF = {"spark.ui.enabled": "false", "spark.log.level": "WARN",
              "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
              "spark.hadoop.fs.permissions.umask-mode": "002"}


def spark_submit_defaults() -> dict:
    """What every SparkSubmitOperator of the suite shares: the connection, driver memory, conf and pool."""
    spark = pipeline_config().spark
    return {"conn_id": spark.conn_id, "driver_memory": spark.driver_memory, "conf": SPARK_CONF, "pool": "spark"}


DEFAULT_ARGS = {
    "owner": OWNER,
    "retries": 2,
    "retry_delay": timedelta(minutes=1),
    "retry_exponential_backoff": True,
    "on_failure_callback": failure_alert(),
}
