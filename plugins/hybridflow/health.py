"""Checks that each part of the estate answers: the Slurm GPU partition over SSH, and Triton.

Each check raises :class:`~hybridflow.exceptions.HealthCheckError` naming the component, what was seen and
what to do; on success it returns a small dict of facts for XCom and the task log.
"""

from __future__ import annotations

import time

from hybridflow.exceptions import HealthCheckError
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.slurm import (
    SACCT_FORMAT,
    SINFO_GPU_FORMAT,
    SUCCESS_STATES,
    is_final,
    latest_by_job_id,
    parse_sacct,
    parse_sbatch_parsable,
    parse_sinfo_gpus,
)

GPU_PROBE_SCRIPT = """#!/bin/bash
echo "host=$(hostname) user=$(id -un) gpus=${CUDA_VISIBLE_DEVICES:-none}"
"""


def check_slurm_partition(ssh_conn_id: str, partition: str) -> dict:
    """The partition has at least one schedulable node with GPUs declared."""
    hook = SlurmHook(ssh_conn_id)
    try:
        result = hook.run(["sinfo", "--noheader", "--Node", "--partition", partition, "--Format", SINFO_GPU_FORMAT])
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


def run_gpu_probe_job(ssh_conn_id: str, partition: str, timeout_s: float = 120) -> dict:
    """Submit a one-GPU job (script on stdin) and wait for it to end COMPLETED in accounting."""
    hook = SlurmHook(ssh_conn_id)
    try:
        submitted = hook.run(
            ["sbatch", "--parsable", f"--partition={partition}", "--gres=gpu:1", "--time=2",
             "--job-name=hybridflow-healthcheck", "--output=/dev/null"],
            stdin=GPU_PROBE_SCRIPT,
        )
        if submitted.returncode != 0:
            raise HealthCheckError(f"slurm: sbatch on {hook.endpoint} failed: {submitted.stderr.strip()}")
        job_id = parse_sbatch_parsable(submitted.stdout)
        deadline = time.monotonic() + timeout_s
        delay = 0.5
        while time.monotonic() < deadline:
            acct = hook.run(["sacct", "-X", "-P", "-n", "-j", job_id, f"--format={SACCT_FORMAT}"])
            record = latest_by_job_id(parse_sacct(acct.stdout)).get(job_id) if acct.returncode == 0 else None
            if record and is_final(record.state, requeue_enabled=False):
                if record.state not in SUCCESS_STATES:
                    raise HealthCheckError(
                        f"slurm: probe job {job_id} ended {record.state} (exit {record.exit_code}:{record.exit_signal})"
                    )
                return {"job_id": job_id, "state": record.state, "gpus": record.gpus,
                        "elapsed_s": record.elapsed_seconds}
            time.sleep(delay)
            delay = min(delay * 2, 8)
        hook.run(["scancel", job_id])
        raise HealthCheckError(f"slurm: probe job {job_id} did not finish within {timeout_s:.0f} s; cancelled it")
    finally:
        hook.close()


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
