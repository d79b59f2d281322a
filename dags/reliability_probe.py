"""
### Reliability probe (test only)

One GPU job on `gpu-training` that only sleeps, followed by the deferrable Slurm operator, in the
`gpu_training` pool like the nightly training job. The reliability tests (`tests/reliability/`) trigger it on
the running Airflow, then mark the task failed or restart the triggerer while it is deferred, or start 20 runs
at once, and check what happened to the Slurm jobs. Not for production use.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.params import integer, strict_params

config = pipeline_config()

with DAG(
    dag_id="reliability_probe",
    schedule=None,
    catchup=False,
    max_active_runs=25,  # the load test starts 20 at once; the pool, not this, must hold them back
    default_args=DEFAULT_ARGS,
    tags=["test"],
    doc_md=__doc__,
    params=strict_params({
        "sleep_s": Param(120, **integer(1, 600), description="How long the Slurm job sleeps, in seconds."),
    }),
):
    SlurmSubmitOperator(
        task_id="sleep_job",
        command=["sleep", "{{ params.sleep_s }}"],
        partition="gpu-training",
        gpus_per_node=1,
        time_limit=15,
        signal=None,
        log_dir=config.storage.layout.run_logs("reliability_probe"),
        ssh_conn_id=config.cluster.ssh_conn_id,
        poll_interval_s=2,
        wait_before_defer_s=0,  # the probe exists to exercise the deferred path (the triggerer)
        pool="gpu_training",
    )
