"""Checks that each part of the estate answers: the Slurm GPU partition over SSH, Spark, and Triton.

Each check raises :class:`~hybridflow.exceptions.HealthCheckError` naming the component, what was seen and
what to do; on success it returns a small dict of facts for XCom and the task log.
"""

from __future__ import annotations

from hybridflow.exceptions import HealthCheckError
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.capacity import capacity_sinfo_argv
from hybridflow.utils.slurm import parse_sinfo_gpus


def check_slurm_partition(ssh_conn_id: str, partition: str) -> dict:
    """The partition has at least one schedulable node with GPUs declared."""
    hook = SlurmHook(ssh_conn_id)
    try:
        result = hook.run(capacity_sinfo_argv(partition))
    finally:
        hook.close()
    nodes = parse_sinfo_gpus(result.stdout) if result.returncode == 0 else []
    if not nodes:
        raise HealthCheckError(
            f"slurm: partition {partition!r} not found on {hook.endpoint} ({result.stderr.strip() or 'no nodes'}); "
            "check the partition name and `sinfo` on the login node; see include/runbooks/platform-healthcheck.md"
        )
    usable = [n for n in nodes if n.available and n.gpus_total > 0]
    if not usable:
        states = ", ".join(f"{n.name}={n.state}{n.flags} gpus={n.gpus_total}" for n in nodes)
        raise HealthCheckError(
            f"slurm: partition {partition!r} has no schedulable GPU node ({states}); "
            "see include/runbooks/platform-healthcheck.md"
        )
    return {"partition": partition, "nodes": len(usable), "gpus_total": sum(n.gpus_total for n in usable),
            "gpus_free": sum(n.gpus_free for n in usable)}


def check_spark(spark_conn_id: str) -> dict:
    """spark-submit the probe job through the connection's master; its Python workers must compute right."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from hybridflow.paths import jobs_dir

    hook = SparkSubmitHook(conn_id=spark_conn_id, name="hybridflow-healthcheck", application_args=["100000"])
    try:
        hook.submit(str(jobs_dir() / "spark_healthcheck.py"))
    except Exception as exc:  # the hook raises a bare AirflowException with the return code
        raise HealthCheckError(
            f"spark: the probe job on connection {spark_conn_id!r} failed: {exc}; see the task log for the driver "
            "output and include/runbooks/platform-healthcheck.md"
        ) from exc
    return {"conn_id": spark_conn_id, "master": hook._connection["master"]}


def check_triton(triton_conn_id: str) -> dict:
    hook = TritonHook(triton_conn_id)
    if not hook.is_server_ready():
        raise HealthCheckError(
            f"triton: server at {hook.url} is not ready; see include/runbooks/platform-healthcheck.md"
        )
    return {"url": hook.url, "models": len(hook.repository_index())}
