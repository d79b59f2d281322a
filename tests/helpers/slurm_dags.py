"""The small DAG the Slurm tests run through ``run_dag``: one SlurmSubmitOperator task."""

from __future__ import annotations

import textwrap

SLURM_DAG = textwrap.dedent('''
    from datetime import datetime
    from airflow.sdk import DAG
    from hybridflow.operators.slurm import SlurmSubmitOperator

    with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        SlurmSubmitOperator(
            task_id="job",
            command={command!r},
            partition="gpu-training",
            gpus_per_node=1,
            time_limit=5,
            log_dir={log_dir!r},
            poll_interval_s=2,
            retries=0,{options}
        )
''')


def slurm_dag(dag_id: str, command: list[str], log_dir: str, **options) -> str:
    """The source of DAG ``dag_id``: one task ``job`` that runs ``command`` as a Slurm job on one GPU of the
    gpu-training partition (5 min limit, logs in ``log_dir``, polled every 2 s, no retries). ``options`` are
    more operator arguments, written as given (progress_path, signal, reconnect_budget_s, deferrable, ...). The task
    defers at once (``wait_before_defer_s=0``) unless told otherwise: these tests follow jobs through the trigger."""
    options.setdefault("wait_before_defer_s", 0)
    lines = "".join(f"\n        {key}={value!r}," for key, value in options.items())
    return SLURM_DAG.format(dag_id=dag_id, command=command, log_dir=log_dir, options=lines)
