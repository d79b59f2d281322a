"""
### Platform health check

Proves every part of the estate answers, end to end through Airflow: the GPU Slurm partition over SSH (host key
verified) with a real one-GPU job followed by the deferrable Slurm operator, Spark through `spark-submit`, and
the Triton server. On-call: run it first when a pipeline stage fails for no obvious reason. Runbook:
`include/runbooks/platform-healthcheck.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.params import strict_params, text

config = pipeline_config()
# The job prints where it ran, holds the GPU for hold_s ($1), and, last, when it ended (the trigger_latency
# benchmark reads that line).
PROBE = ('echo "host=$(hostname) user=$(id -un) gpus=${CUDA_VISIBLE_DEVICES:-none}"; sleep "$1"; '
         'echo "ended_at=$(date +%s.%N)"')

with DAG(
    dag_id="platform_healthcheck",
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["platform", "on-call"],
    doc_md=__doc__,
    params=strict_params({
        "partition": Param(config.cluster.partition, **text(r"[A-Za-z0-9_-]{1,64}"),
                           description="Slurm partition that must be up and declare GPUs."),
        "run_spark": Param(True, type="boolean", description="Also spark-submit the probe job."),
        "spark_conn_id": Param("spark_default", type="string", enum=["spark_default", "spark_standalone"],
                               description="Spark connection to submit the probe job to."),
        "hold_s": Param(0, type="integer", minimum=0, maximum=600,
                        description="Keep the GPU job running this many seconds (0-600): a job longer than the "
                                    "task's wait before deferring shows the hand-back through the triggerer."),
    }),
):

    @task
    def slurm_partition(params=None) -> dict:
        from hybridflow.pipeline.health import check_slurm_partition

        return check_slurm_partition(config.cluster.ssh_conn_id, params["partition"])

    gpu_job = SlurmSubmitOperator(
        task_id="slurm_gpu_job",
        command=["bash", "-c", PROBE, "probe", "{{ params.hold_s }}"],
        partition="{{ params.partition }}",
        gpus_per_node=1,
        time_limit=15,
        requeue=False,
        signal=None,
        log_dir=config.storage.layout.run_logs("healthcheck"),
        ssh_conn_id=config.cluster.ssh_conn_id,
        poll_interval_s=5,
        runbook="include/runbooks/platform-healthcheck.md",
    )

    @task
    def spark_submit(params=None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException
        from hybridflow.pipeline.health import check_spark

        if not params["run_spark"]:
            raise AirflowSkipException("run_spark is off")
        return check_spark(params["spark_conn_id"])

    @task
    def triton_server() -> dict:
        from hybridflow.pipeline.health import check_triton

        return check_triton("triton_default")

    slurm_partition() >> gpu_job
    spark_submit()
    triton_server()
