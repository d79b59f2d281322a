"""
### GPU partition ledger

How well each GPU partition was used, per day, and by whom: available GPU-hours (less nodes' down and drained
time), allocated GPU-hours, utilization, idle hours, the split by DAG, task and user and the hours of jobs that are
not the suite's, queue wait p50/p95 and the CPU efficiency of GPU jobs, all from Slurm's accounting (`sacct`,
`sacctmgr show event`). One stored row per partition and day (`<storage>/utilization/`); reruns and backfills
replace it. The UI page Browse -> GPU utilization charts the last 30 days.

Scheduled after midnight: the day that ended, and the new day so far. From the trigger form: `start_day` and
`end_day` recompute a range of past days. On-call hears (`low_utilization`) when a partition stays under
`utilization.target` for `utilization.alert_days` complete days. Runbook: `include/runbooks/utilization.md`.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS, failure_alert
from hybridflow.params import DATE, strict_params, text
from hybridflow.timetables import cron_schedule

config = pipeline_config()
OPTIONAL_DAY = f"(?:{DATE})?"

with DAG(
    dag_id="cluster_utilization",
    schedule=cron_schedule(config.utilization.schedule),
    catchup=False,  # past days: a date range from the trigger form, or `airflow backfill create`
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["platform", "slurm", "utilization"],
    doc_md=__doc__,
    params=strict_params({
        "start_day": Param("", **text(OPTIONAL_DAY),
                           description="First day to compute (YYYY-MM-DD); empty: the day before the run and the "
                                       "run's day so far."),
        "end_day": Param("", **text(OPTIONAL_DAY),
                         description="Last day to compute (YYYY-MM-DD, at most 92 days after start_day); empty: "
                                     "start_day."),
    }),
):

    @task(execution_timeout=timedelta(minutes=30))
    def ledger(params=None, dag_run=None) -> list[dict]:
        from hybridflow.pipeline.utilization import run_ledger

        return run_ledger(config, params, dag_run.run_after)  # a manual run has no data interval

    @task(execution_timeout=timedelta(minutes=5))
    def check_target(stored: list[dict], ti=None) -> list[str]:
        from hybridflow.pipeline.utilization import alert_low_utilization

        return alert_low_utilization(config, stored, ti, notifier=failure_alert())

    check_target(ledger())
