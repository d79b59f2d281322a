"""
### On-call: cancel or requeue a training job

Cancels or requeues one Slurm job of the suite's, by id, and proves it from the job's own state: a cancel
ends CANCELLED (`scancel` exits 0 even when it did nothing); a requeue (`scontrol requeue`) puts the job back
in the queue with a higher restart count, and the training job resumes from its newest checkpoint. Refused,
with the reason: an id Slurm does not know, a job that is not ours (its name is not one the suite's operators
give), a job that has already finished, a requeue of a job that is not running.

On-call uses it when a training job hangs, holds GPUs it does not use or sits on a bad node (requeue), or must
stop now (cancel). The `reason` is written to the task log with the states before and after, and as tag
`hybridflow.oncall_action` on the job's MLflow training run (found by its job name). Runbook:
`include/runbooks/oncall.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.params import strict_params, text

config = pipeline_config()
ssh_conn_id = config.cluster.ssh_conn_id
# Slurm job ids are 32-bit, array task ids at most 4000000; no leading zeros.
JOB_ID = r"[1-9][0-9]{0,9}(_(0|[1-9][0-9]{0,6}))?"
# One line of printable text that starts and ends with a visible character (no control characters).
ONE_LINE = r"[^\x00-\x20\x7f]([^\x00-\x1f\x7f]*[^\x00-\x20\x7f])?"

with DAG(
    dag_id="oncall_training_job",
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["on-call", "training", "gpu"],
    doc_md=__doc__,
    params=strict_params({
        "job_id": Param(**text(JOB_ID),
                        description="The Slurm job id (from the alert or the training task's log), e.g. "
                                    "4242, or 4242_3 for an array task."),
        "action": Param("cancel", type="string", enum=["cancel", "requeue"],
                        values_display={"cancel": "cancel: stop the job for good",
                                        "requeue": "requeue: back to the queue; resumes from its checkpoint"},
                        description="cancel ends the job (CANCELLED); requeue sends a running job back to "
                                    "the queue."),
        "reason": Param(**text(ONE_LINE, maxLength=500),
                        description="Why, in one line (recorded in the task log with the before and after "
                                    "states)."),
    }),
):

    @task
    def look_up_job(params=None, dag_run=None) -> dict:
        from airflow.sdk.exceptions import AirflowFailException
        from hybridflow.exceptions import JobActionRefused
        from hybridflow.hooks.slurm import SlurmHook
        from hybridflow.pipeline.oncall_actions import look_up

        hook = SlurmHook(ssh_conn_id)
        try:
            before = look_up(hook, params["job_id"], params["action"])
        except JobActionRefused as exc:  # a refusal would be the same on retry
            raise AirflowFailException(f"{params['action']} refused: {exc}") from exc
        finally:
            hook.close()
        requested_by = getattr(dag_run, "triggering_user_name", None) or "unknown"
        print(f"On-call {params['action']} of Slurm job {before['job_id']} ({before['name']}, "
              f"{before['state']}) requested by {requested_by}; reason: {params['reason']!r}")
        return before

    @task
    def apply_action(before: dict, params=None) -> dict:
        from hybridflow.hooks.slurm import SlurmHook
        from hybridflow.pipeline.oncall_actions import act

        hook = SlurmHook(ssh_conn_id)
        try:
            after = act(hook, before, params["action"]).to_event()
        finally:
            hook.close()
        print(f"Slurm job {before['job_id']}: {before['state']} (restarts {before['restarts']}) -> "
              f"{after['state']} (restarts {after['restarts']}) after {params['action']}; "
              f"reason: {params['reason']!r}")
        return {"job_id": before["job_id"], "action": params["action"], "reason": params["reason"],
                "before": before, "after": after}

    @task
    def record_in_mlflow(action: dict, dag_run=None) -> str:
        from hybridflow.hooks.mlflow import MlflowHook
        from hybridflow.pipeline.oncall_actions import record_in_mlflow

        requested_by = getattr(dag_run, "triggering_user_name", None) or "unknown"
        recorded = record_in_mlflow(MlflowHook(), config.nightly.mlflow_experiment, action, requested_by)
        print(recorded)
        return recorded

    record_in_mlflow(apply_action(look_up_job()))
