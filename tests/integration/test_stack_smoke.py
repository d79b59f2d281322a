"""Smoke tests proving each service of the local stack is the real thing, reached the way the DAGs reach it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers.stack import s3_client
from helpers.triton_models import tiny_model
from hybridflow.exceptions import SlurmConnectionError
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.triton import ModelConfigSpec, python_backend_source, render_model_config

REPO = Path(__file__).resolve().parents[2]


def wait_for_sacct_state(hook: SlurmHook, job_id: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = hook.run(["sacct", "-X", "-P", "-n", "-j", job_id, "--format=State"]).stdout.split()
        state = out[0] if out else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state
        time.sleep(0.5)
    return state


def test_slurm_gpu_job_over_ssh_runs_to_completed_as_job_user(stack, tmp_path):
    hook = SlurmHook("slurm_ssh")
    marker = f"smoke-{uuid.uuid4().hex[:8]}"
    script = '#!/bin/bash\necho "user=$(id -un) gpus=$CUDA_VISIBLE_DEVICES job=$SLURM_JOB_ID"\n'
    out_file = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/scratch/{marker}.out"
    try:
        submitted = hook.run(
            ["sbatch", "--parsable", "--partition=gpu-training", "--gres=gpu:1", f"--job-name={marker}",
             f"--output={out_file}"],
            stdin=script,
        )
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        assert wait_for_sacct_state(hook, job_id) == "COMPLETED"
        # slurmdbd records the name as "allocation" for a few seconds after the job starts (measured here),
        # so a lookup by name polls until accounting has caught up.
        deadline, by_name = time.monotonic() + 20, ""
        while time.monotonic() < deadline and not by_name.startswith(job_id + "|"):
            time.sleep(0.5)
            by_name = hook.run(["sacct", "-X", "-P", "-n", f"--name={marker}", "--format=JobID,AllocTRES"]).stdout
        assert by_name.startswith(job_id + "|"), by_name
        assert "gres/gpu=1" in by_name
        printed = hook.run(["cat", out_file]).stdout.strip()
        assert printed.startswith("user=mlops gpus=")
        assert printed.split("gpus=")[1].split()[0].isdigit(), printed  # Slurm bound one GPU index
        assert f"job={job_id}" in printed
    finally:
        hook.run(["rm", "-f", out_file])
        hook.close()


def test_slurm_partitions_and_gres_are_declared(stack):
    hook = SlurmHook("slurm_ssh")
    try:
        rows = hook.run(["sinfo", "--noheader", "--format=%P|%a|%G"]).stdout.split()
    finally:
        hook.close()
    assert sorted(rows) == ["cpu*|up|gpu:h200:8", "gpu-training|up|gpu:h200:8"]


def test_slurm_refuses_more_gpus_than_the_node_has(stack):
    hook = SlurmHook("slurm_ssh")
    try:
        result = hook.run(["sbatch", "--parsable", "--partition=gpu-training", "--gres=gpu:9", "--wrap=true"])
    finally:
        hook.close()
    assert result.returncode != 0
    assert "Requested node configuration is not available" in result.stderr


def conn_env_with_extra(stack, **extra_changes) -> str:
    conn = json.loads(stack["AIRFLOW_CONN_SLURM_SSH"])
    conn["extra"].update(extra_changes)
    conn["extra"] = {k: v for k, v in conn["extra"].items() if v is not None}
    return json.dumps(conn)


@pytest.mark.parametrize("known_hosts_has_real_key", [False, True], ids=["no-known-hosts", "known-hosts-real-key"])
def test_slurm_ssh_refuses_a_wrong_host_key(stack, tmp_path, monkeypatch, known_hosts_has_real_key):
    """The connection's pinned key is the only one trusted, even when ~/.ssh/known_hosts (which paramiko would
    prefer) holds the server's real key."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    wrong_key = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    conn = json.loads(stack["AIRFLOW_CONN_SLURM_SSH"])
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    if known_hosts_has_real_key:
        real_key = " ".join(conn["extra"]["host_key"].split()[:2])
        (home / ".ssh" / "known_hosts").write_text(f"[{conn['host']}]:{conn['port']} {real_key}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AIRFLOW_CONN_SLURM_SSH_WRONG", conn_env_with_extra(stack, host_key=wrong_key))
    hook = SlurmHook("slurm_ssh_wrong", conn_retry_attempts=1)
    with pytest.raises(SlurmConnectionError, match="does NOT match"):
        hook.run(["touch", "/tmp/should-not-exist"])


def test_slurm_ssh_refuses_an_unknown_host(stack, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SLURM_SSH_UNKNOWN", conn_env_with_extra(stack, host_key=None))
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.ssh/known_hosts to fall back on
    hook = SlurmHook("slurm_ssh_unknown", conn_retry_attempts=1)
    with pytest.raises(SlurmConnectionError, match="unknown"):
        hook.run(["true"])


def test_slurm_ssh_refuses_a_connection_that_disables_host_key_checks(stack, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_SLURM_SSH_NOCHECK", conn_env_with_extra(stack, host_key=None, no_host_key_check=True)
    )
    with pytest.raises(SlurmConnectionError, match="disables host key verification"):
        SlurmHook("slurm_ssh_nocheck").run(["true"])


def test_slurm_ssh_allows_only_key_auth_for_the_job_user(stack):
    """sshd itself refuses passwords and root: the server's effective config, not our intent."""
    conf = Path(stack["HYBRIDFLOW_CLUSTER_DIR"]) / "sshd" / "sshd_config"
    effective = subprocess.run(["/usr/sbin/sshd", "-T", "-f", str(conf)], capture_output=True, text=True,
                               check=True).stdout.lower().splitlines()
    assert "passwordauthentication no" in effective
    assert "permitrootlogin no" in effective
    assert "allowusers mlops" in effective
    assert "listenaddress 127.0.0.1:2222" in effective


@pytest.fixture
def tiny_torchscript_model(tmp_path):
    model = tiny_model(0, n_features=4)
    path = tmp_path / "model.pt"
    model.save(str(path))
    return model, path


def test_triton_loads_a_model_and_answers_infer(stack, tiny_torchscript_model):
    import numpy as np
    import torch

    model, model_file = tiny_torchscript_model
    name = f"smoke_{uuid.uuid4().hex[:8]}"
    repo_dir = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "model-repository" / name
    (repo_dir / "1").mkdir(parents=True)
    shutil.copy(model_file, repo_dir / "1" / "model.pt")
    (repo_dir / "1" / "model.py").write_text(python_backend_source())
    (repo_dir / "config.pbtxt").write_text(render_model_config(ModelConfigSpec(name=name, n_features=4)))
    hook = TritonHook("triton_default")
    try:
        hook.load_model(name)
        assert hook.is_model_ready(name, 1)
        batch = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
        expected = model(torch.from_numpy(batch)).detach().numpy()
        np.testing.assert_allclose(hook.infer(name, batch), expected, rtol=1e-5)
        grpc = TritonHook("triton_default", protocol="grpc")
        np.testing.assert_allclose(grpc.infer(name, batch), expected, rtol=1e-5)
    finally:
        hook.unload_model(name)
        shutil.rmtree(repo_dir)


def test_triton_is_the_real_server_with_metrics(stack):
    port = json.loads(stack["AIRFLOW_CONN_TRITON_DEFAULT"])["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2", timeout=5) as resp:
        meta = json.load(resp)
    assert meta["name"] == "triton"
    assert "model_repository" in meta["extensions"]
    with urllib.request.urlopen("http://127.0.0.1:8002/metrics", timeout=5) as resp:
        assert b"nv_inference_request_success" in resp.read()


@pytest.mark.parametrize("conn_id, master", [("spark_default", "local[2]"),
                                             ("spark_standalone", "spark://127.0.0.1:7077")])
def test_spark_submit_runs_a_job(stack, conn_id, master):
    """spark-submit through the provider's hook and the connection the DAGs use."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    hook = SparkSubmitHook(conn_id=conn_id, name="smoke", application_args=["1000"])
    assert hook._connection["master"] == master
    lines = []
    hook._process_spark_submit_log = lambda itr: lines.extend(line.strip() for line in itr)  # noqa: E731
    hook.submit(str(REPO / "jobs" / "spark_healthcheck.py"))
    assert f"HEALTHCHECK master={master} sum=999000 expected=999000" in lines


def test_s3_endpoint_round_trips_an_object(stack):
    s3, _ = s3_client(stack)
    bucket = f"smoke-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="a/b.txt", Body=b"hello")
    assert s3.get_object(Bucket=bucket, Key="a/b.txt")["Body"].read() == b"hello"
    s3.delete_object(Bucket=bucket, Key="a/b.txt")
    s3.delete_bucket(Bucket=bucket)


def test_local_stack_status_reports_every_service_up(stack):
    status = subprocess.run(
        ["python3", str(REPO / "scripts/localstack.py"), "status", "--json"], capture_output=True, text=True,
        env=dict(os.environ),
    )
    rows = json.loads(status.stdout)
    assert status.returncode == 0, f"down: {[r for r in rows if not r['up']]}"
    assert {r["service"] for r in rows} >= {
        "munge", "mariadb", "slurmdbd", "slurmctld", "slurmd-gpu-node-01", "slurmd-gpu-node-02", "sshd",
        "spark-master", "spark-worker", "triton",
        "s3", "airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
    }
    assert all(r["up"] for r in rows)


def test_up_starts_an_airflow_component_whose_process_died_while_its_last_heartbeat_looks_healthy(stack):
    """A SIGKILLed triggerer still shows "healthy" on the api-server's health endpoint for a while (its last
    heartbeat is recent): `up` must start it again, not say "already up" and leave it down. A second `up`, and one
    from another interpreter, then find everything running."""
    def triggerer() -> dict:
        rows = subprocess.run([sys.executable, str(REPO / "scripts/localstack.py"), "status", "--json"],
                              capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
        return next(row for row in json.loads(rows) if row["service"] == "airflow-triggerer")

    def up() -> str:
        return subprocess.run([sys.executable, str(REPO / "scripts/localstack.py"), "up", "airflow-triggerer"],
                              capture_output=True, text=True, check=True, env=dict(os.environ)).stdout

    killed = triggerer()["pid"]
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{killed}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    first = up()
    assert "airflow-triggerer: its process is gone" in first and "airflow-triggerer: starting" in first, first
    started = triggerer()
    assert started["up"] and started["pid"] not in (None, killed)
    assert "airflow-triggerer: already up" in up()
    assert triggerer()["pid"] == started["pid"]
    # Another interpreter and PATH than the last `up` (make's /usr/bin/python3; pyenv's shims rewrite PATH): the
    # components' environment is the same, so nothing restarts.
    again = subprocess.run(["/usr/bin/python3", str(REPO / "scripts/localstack.py"), "up"], capture_output=True,
                           text=True, check=True, env={**os.environ, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}).stdout
    assert "starting" not in again, again
