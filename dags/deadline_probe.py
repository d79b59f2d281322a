"""
### Deadline probe (test only)

One task that sleeps past the DAG's 15 s deadline, the same deadline alert as the nightly's (`run_deadline`):
the scheduler records the deadline when the run is queued, and when it passes the triggerer alerts on-call
(kind `late`) with the stage the run is in. `tests/integration/test_run_deadline.py` triggers it on the running
Airflow and reads the alert. Not for production use.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.dag_defaults import DEFAULT_ARGS, run_deadline
from hybridflow.params import integer, strict_params

DEADLINE_S = 15

with DAG(
    dag_id="deadline_probe",
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["test"],
    doc_md=__doc__,
    deadline=run_deadline(DEADLINE_S),
    params=strict_params({
        "sleep_s": Param(60, **integer(1, 600), description="How long the task sleeps, in seconds."),
    }),
):

    @task
    def sleep_past_the_deadline(params=None) -> int:
        import time

        time.sleep(params["sleep_s"])
        return params["sleep_s"]

    sleep_past_the_deadline()
