"""Checks that each part of the estate answers: the Slurm GPU partition over SSH, and Triton.

Each check raises :class:`~hybridflow.exceptions.HealthCheckError` naming the component, what was seen and
what to do; on success it returns a small dict of facts for XCom and the task log.
"""

from __future__ import annotations

import time

from hybridflow.exceptions import HealthCheckError
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.triton import TritonHook

GPU_PROBE_SCRIPT = """#!/bin/bash
echo "host=$(hostname) user=$(id -un) gpus=${CUDA_VISIBLE_DEVICES:-none}"
"""


def check_slurm_partition(ssh_conn_id: str, partition: str) -> dict:
    """The partition exists, is up, and declares GPUs."""
    hook = SlurmHook(ssh_conn_id)
    try:
        result = hook.run(["sinfo", "--noheader", "--partition", partition, "--format", "%a|%G|%D|%T"])
    finally:
        hook.close()
    rows = [line.split("|") for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not rows:
        raise HealthCheckError(
            f"slurm: partition {partition!r} not found on {hook.endpoint} ({result.stderr.strip() or 'no rows'}); "
            "check the partition name in the pipeline config and `sinfo` on the login node"
        )
    availability, gres, nodes, state = rows[0]
    if availability != "up" or "gpu" not in gres:
        raise HealthCheckError(
            f"slurm: partition {partition!r} is {availability} with GRES {gres!r} ({state}); "
            "see include/runbooks/platform-healthcheck.md"
        )
    return {"partition": partition, "gres": gres, "nodes": int(nodes), "state": state}


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
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout_s
        delay = 0.5
        while time.monotonic() < deadline:
            acct = hook.run(["sacct", "-X", "-P", "-n", "-j", job_id, "--format=State,ExitCode,AllocTRES"])
            fields = acct.stdout.strip().split("|") if acct.stdout.strip() else []
            state = fields[0].split()[0] if fields else ""
            if state == "COMPLETED":
                return {"job_id": job_id, "state": state, "alloc_tres": fields[2]}
            if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                raise HealthCheckError(f"slurm: probe job {job_id} ended {state} (exit {fields[1]})")
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
