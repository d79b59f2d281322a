"""
### Platform health check

Proves every part of the estate answers, end to end through Airflow: the GPU Slurm partition over SSH (host key
verified; optionally a real one-GPU job), Spark through `spark-submit`, and the Triton server.
On-call: run it first when a pipeline stage fails for no obvious reason. Runbook:
`include/runbooks/platform-healthcheck.md`.
"""

from __future__ import annotations

from airflow.sdk import Param, dag, task

from hybridflow.dag_defaults import DEFAULT_ARGS


@dag(
    dag_id="platform_healthcheck",
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["platform", "on-call"],
    doc_md=__doc__,
    params={
        "partition": Param(
            "gpu-training", type="string", pattern=r"^[A-Za-z0-9_-]{1,64}$",
            description="Slurm partition that must be up and declare GPUs.",
        ),
        "submit_gpu_job": Param(
            True, type="boolean", description="Also run a one-GPU probe job to COMPLETED on that partition."
        ),
        "spark_conn_id": Param(
            "spark_default", type="string", enum=["spark_default", "spark_standalone"],
            description="Spark connection to submit the probe job to.",
        ),
    },
)
def platform_healthcheck():
    @task
    def slurm_partition(params=None) -> dict:
        from hybridflow.health import check_slurm_partition

        return check_slurm_partition("slurm_ssh", params["partition"])

    @task
    def slurm_gpu_job(params=None) -> dict | None:
        from hybridflow.health import run_gpu_probe_job

        return run_gpu_probe_job("slurm_ssh", params["partition"]) if params["submit_gpu_job"] else None

    @task
    def triton_server() -> dict:
        from hybridflow.health import check_triton

        return check_triton("triton_default")

    @task
    def spark_submit(params=None) -> dict:
        from hybridflow.health import check_spark

        return check_spark(params["spark_conn_id"])

    slurm_partition() >> slurm_gpu_job()
    spark_submit()
    triton_server()


platform_healthcheck()
