"""
### Slurm orphan reconciler

Cancels the suite's Slurm jobs whose task no longer runs: a task marked failed in the second or two between its
deferral and the triggerer starting its trigger, a worker killed outright, a deleted DAG run all leave the job
running, holding GPUs nobody waits for.

Each pass lists the job user's jobs (`squeue`, as the `slurm_ssh` login), reads each job's task instance from its
comment (the job key the suite's operators write, checked against the job's name), looks the task instance up in
Airflow, and cancels the job when the task is not live (not scheduled, queued, running, deferred, up for retry,
up for reschedule or restarting; a task without a state in an active run counts as live) and the job is older
than `grace_s`. Each cancel is proven from Slurm's own state (CANCELLED). Never touched: another user's job, a
name without the suite's prefix, a job without a readable key, a live task's job. One line per job in the task log
(job id, name, DAG/run/task, task state, decision); an on-call alert when a pass cancels something.

On-call: trigger it with `dry_run` to see what it would cancel. Runbook: `include/runbooks/slurm-reconciler.md`.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS, failure_alert
from hybridflow.params import integer, strict_params, text
from hybridflow.timetables import cron_schedule
from hybridflow.utils.reconcile import MAX_GRACE_S

config = pipeline_config()
DAG_ID = r"[A-Za-z0-9_.-]{1,250}"

with DAG(
    dag_id="slurm_reconciler",
    schedule=cron_schedule(config.reconciler.schedule),  # a missed tick is skipped: the next pass covers it
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["platform", "on-call", "slurm"],
    doc_md=__doc__,
    params=strict_params({
        "dry_run": Param(False, type="boolean",
                         description="List what would be cancelled, and cancel nothing."),
        "grace_s": Param(config.reconciler.grace_s, **integer(0, MAX_GRACE_S),
                         description="Cancel a job of a task that is not live only once the job is this many "
                                     "seconds old (its submit time on the cluster's clock)."),
        "dag_ids": Param([], type="array", items=text(DAG_ID), maxItems=50,
                         description="Only judge the jobs of these DAGs (one DAG id per line); empty: every DAG."),
    }),
):

    @task(execution_timeout=timedelta(minutes=10), multiple_outputs=False)
    def reconcile(params=None, ti=None) -> dict:
        from hybridflow.pipeline.reconciler import reconcile_cluster

        return reconcile_cluster(config.cluster.ssh_conn_id, ti, grace_s=params["grace_s"],
                                 dry_run=params["dry_run"], dag_ids=params["dag_ids"], notifier=failure_alert())

    reconcile()
