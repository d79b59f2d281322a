"""TritonDeployOperator, its readiness trigger and the on-call rollback DAG against the real local tritonserver,
through Airflow's task lifecycle (execute -> defer -> trigger -> execute_complete) in dag.test(), while a client
in another process keeps sending requests; S3 publishing against the local S3 endpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers.stack import s3_client
from helpers.triton_models import (
    LOADED_MACHINE_SLO_P99_MS,
    N_FEATURES,
    deploy_dag,
    make_export,
    publish_and_serve,
    ready_versions,
    remove_model,
)
from hybridflow.hooks.model_repository import LocalModelRepository, S3ModelRepository, open_repository
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.triton import RECORD_FILE, Repository, VersionRecord, VersionStatus

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_name(stack, repository):
    name = f"t_deploy_{uuid.uuid4().hex[:8]}"
    yield name
    remove_model(repository, name)


def deploy(run_dag, loop, label: str, export_dir: Path, model: str, repository: str) -> dict:
    dag_id = f"t_deploy_{label}_{uuid.uuid4().hex[:6]}"
    started = time.time()
    result = run_dag(deploy_dag(dag_id, export_dir, model, repository), dag_id)
    if loop is not None:
        loop.windows[label] = (started, time.time())
    return result


def records(repository: str, model: str) -> dict[int, VersionRecord]:
    return LocalModelRepository(Repository.parse(repository)).records(model)


def test_deploy_promotes_good_versions_rolls_back_bad_ones_and_oncall_restores_with_no_failed_request(
    run_dag, model_name, repository, tmp_path, client_loop
):
    first = deploy(run_dag, None, "v1", make_export(tmp_path / "e1", 1), model_name, repository)
    assert first["state"] == "success", first["log"][-4000:]
    report = first["tasks"]["deploy"]["xcom"]["return_value"]
    assert report["version"] == 1 and report["previous_version"] is None and report["promoted"] is True
    assert ready_versions(model_name) == [1]

    loop = client_loop(model_name)
    time.sleep(1)

    second = deploy(run_dag, loop, "v2", make_export(tmp_path / "e2", 2), model_name, repository)
    assert second["state"] == "success", second["log"][-4000:]
    xcom = second["tasks"]["deploy"]["xcom"]
    report = xcom["return_value"]
    assert (report["version"], report["previous_version"], report["promoted"]) == (2, 1, True)
    assert report["smoke"]["rows"] == 16 and report["smoke"]["max_abs_error"] <= report["smoke"]["atol"] == 1e-5
    assert report["latency"]["requests"] == 100 and report["latency"]["failed"] == 0
    assert 0 < report["latency"]["p50_ms"] <= report["latency"]["p99_ms"]
    assert report["latency"]["p99_low_ms"] <= report["slo_p99_ms"]
    # measured beside version 1, which serves, under the same load at the same time
    assert report["latency"]["baseline"]["version"] == 1 and report["latency"]["decision"].startswith("pass: ")
    assert report["slo_p99_ms"] == LOADED_MACHINE_SLO_P99_MS
    assert report["load_s"] > 0 and report["latency"]["throughput_rps"] > 0
    assert xcom["deploy_report"] == report
    assert xcom["_link_TritonModelStatusLink"] == f"http://127.0.0.1:8000/v2/models/{model_name}/versions/2"
    with urllib.request.urlopen(xcom["_link_TritonModelStatusLink"], timeout=5) as page:
        assert json.load(page)["versions"] == ["2"]
    assert "Pausing task as DEFERRED" in second["log"] and "Trigger completed" in second["log"]
    assert ready_versions(model_name) == [2]  # v1 gone

    broken = deploy(run_dag, loop, "v3", make_export(tmp_path / "e3", 3, kind="broken"), model_name, repository)
    assert broken["state"] == "failed"
    report = broken["tasks"]["deploy"]["xcom"]["deploy_report"]
    assert (report["version"], report["previous_version"], report["promoted"]) == (3, 2, False)
    assert "did not load" in report["reason"] and "PytorchStreamReader" in report["reason"]  # the server's words
    assert "was rolled back" in broken["log"] and "version 2 keeps serving" in broken["log"]
    assert ready_versions(model_name) == [2]

    wrong = deploy(run_dag, loop, "v4", make_export(tmp_path / "e4", 4, kind="wrong"), model_name, repository)
    assert wrong["state"] == "failed"
    report = wrong["tasks"]["deploy"]["xcom"]["deploy_report"]
    assert (report["version"], report["promoted"]) == (4, False)
    assert report["smoke"]["max_abs_error"] > report["smoke"]["atol"] and "smoke test failed" in report["reason"]
    assert report["latency"] is None
    assert ready_versions(model_name) == [2]

    again = deploy(run_dag, loop, "v2-again", tmp_path / "e2", model_name, repository)
    assert again["state"] == "success", again["log"][-4000:]
    report = again["tasks"]["deploy"]["xcom"]["return_value"]
    assert (report["version"], report["reused_version"], report["promoted"]) == (2, True, True)

    found = records(repository, model_name)
    assert sorted(found) == [1, 2, 3, 4]  # the rerun published nothing new
    assert {v: r.status for v, r in found.items()} == {
        1: VersionStatus.PROMOTED, 2: VersionStatus.PROMOTED, 3: VersionStatus.ROLLED_BACK,
        4: VersionStatus.ROLLED_BACK}
    assert found[2].sha256 == report["sha256"]

    started = time.time()
    rollback = run_dag((REPO / "dags" / "oncall_rollback_model.py").read_text(), "oncall_rollback_model",
                       conf={"model_name": model_name})
    loop.windows["on-call rollback"] = (started, time.time())
    assert rollback["state"] == "success", rollback["log"][-4000:]
    assert rollback["tasks"]["plan"]["xcom"]["return_value"] == {"model": model_name, "version": 1,
                                                                  "from_version": 2}
    restored = rollback["tasks"]["rollback"]["xcom"]["return_value"]
    assert (restored["version"], restored["rolled_back_from"]) == (1, 2)
    assert restored["smoke"]["max_abs_error"] <= 1e-5
    assert ready_versions(model_name) == [1]
    assert records(repository, model_name)[2].status is VersionStatus.ROLLED_BACK
    # Versions deployed by hand name no registry version: the champion alias is left where it is, and it says so.
    moved = rollback["tasks"]["move_champion"]["xcom"]["return_value"]
    assert moved.startswith("champion not moved") and "deployed outside the pipeline" in moved, moved

    time.sleep(0.5)
    events = loop.stop()
    assert [e for e in events if e[3]] == []  # not one request failed, whatever the deploy did
    for label, (start, end) in loop.windows.items():
        during = [e for e in events if start <= e[0] <= end]
        assert len(during) > 20, f"the client was starved during {label}: {len(during)} requests"
    assert {"1", "2"} <= {e[2] for e in events}
    assert "3" not in {e[2] for e in events}  # a version that never loaded never answered


def test_rollback_dag_with_nothing_to_restore_names_the_fix(run_dag, model_name, repository, tmp_path):
    # version 1 published and served as a first deploy leaves it (the deploy itself is the test above)
    publish_and_serve(repository, model_name, {1: make_export(tmp_path / "e1", 11)})
    result = run_dag((REPO / "dags" / "oncall_rollback_model.py").read_text(), "oncall_rollback_model",
                     conf={"model_name": model_name})
    assert result["state"] == "failed"
    assert f"{model_name}: no version was promoted before version 1" in result["log"]
    assert "give the version to restore" in result["log"]
    assert ready_versions(model_name) == [1]


def test_readiness_trigger_times_out_with_the_servers_state(stack, model_name, repository, tmp_path):
    """A version the server was never asked to load: the wait ends at its deadline and says what it saw."""
    import asyncio

    from hybridflow.triggers.triton import TritonModelReadyTrigger

    trigger = TritonModelReadyTrigger("triton_default", model_name, version=7, timeout_s=2.0, load=False,
                                      poll_interval_s=0.3, carry={"k": 1})
    assert trigger.serialize()[0] == "hybridflow.triggers.triton.TritonModelReadyTrigger"
    started = time.monotonic()
    event = asyncio.run(trigger.wait())
    assert 1.9 < time.monotonic() - started < 10
    assert event["status"] == "timeout" and event["carry"] == {"k": 1}
    assert f"{model_name} version 7 was not ready after 2 s" in event["message"]


def test_readiness_trigger_reports_the_load_error_of_an_unknown_model(stack, model_name):
    import asyncio

    from hybridflow.triggers.triton import TritonModelReadyTrigger

    event = asyncio.run(TritonModelReadyTrigger("triton_default", model_name, version=1, timeout_s=30).wait())
    assert event["status"] == "failed"
    assert "127.0.0.1:8001" in event["message"] and model_name in event["message"]


# ------------------------------------------------------------------------------------------------ S3 repository
@pytest.fixture
def s3_bucket(stack):
    s3, conn = s3_client(stack)
    bucket = f"t-repo-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    yield bucket, s3, conn
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
    s3.delete_bucket(Bucket=bucket)


def test_s3_publish_writes_objects_then_record_and_numbers_past_half_written_versions(s3_bucket, tmp_path):
    from hybridflow.utils.triton import read_export

    bucket, s3, _ = s3_bucket
    repo = open_repository(f"s3://{bucket}/serving/models", "storage_s3")
    assert isinstance(repo, S3ModelRepository)
    bundle = read_export(make_export(tmp_path / "e1", 21))
    record = VersionRecord(version=1, sha256=bundle.sha256, n_features=N_FEATURES, source="e1", published_at="t")
    repo.publish_version("m", 1, bundle.version_files(), record)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == [f"serving/models/m/1/{f}" for f in
                    ("hybridflow.json", "model.pt", "model.py", "signature.json", "smoke.json")]
    # A crashed upload: objects without the record. Numbering skips it, idempotency ignores it.
    s3.put_object(Bucket=bucket, Key="serving/models/m/2/model.pt", Body=b"partial")
    assert repo.versions("m") == [1, 2]
    assert sorted(repo.records("m")) == [1]
    assert repo.write_config("m", "config one") is True
    assert repo.write_config("m", "config one") is False
    with pytest.raises(Exception, match="already exists"):
        repo.publish_version("m", 1, bundle.version_files(), record)
    repo.remove_model("m")
    assert repo.versions("m") == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3_triton(s3_bucket, monkeypatch, tmp_path):
    """A second real tritonserver (the same bundled binary) whose model repository is the S3 bucket."""
    from stack import triton

    bucket, s3, conn = s3_bucket
    s3.put_object(Bucket=bucket, Key="models/README", Body=b"Triton needs the repository prefix to exist")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    endpoint = conn["extra"]["endpoint_url"].removeprefix("http://")
    env = dict(triton.triton_env(), AWS_ACCESS_KEY_ID=conn["login"], AWS_SECRET_ACCESS_KEY=conn["password"],
               AWS_DEFAULT_REGION="us-east-1")
    log = open(tmp_path / "triton-s3.log", "w")
    server = subprocess.Popen(
        [str(triton.pytriton_dir() / "tritonserver/bin/tritonserver"),
         f"--model-repository=s3://{endpoint}/{bucket}/models", "--model-control-mode=explicit",
         "--http-address=127.0.0.1", f"--http-port={http_port}", "--grpc-address=127.0.0.1",
         f"--grpc-port={grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
         f"--backend-directory={triton.triton_backend_dir()}", "--exit-timeout-secs=5",
         f"--backend-config=python,shm-region-prefix-name=ts3{http_port}"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"S3-backed tritonserver did not start: {(tmp_path / 'triton-s3.log').read_text()[-2000:]}")
            time.sleep(0.3)
    monkeypatch.setenv("AIRFLOW_CONN_TRITON_S3", json.dumps({
        "conn_type": "triton", "host": "127.0.0.1", "port": http_port,
        "extra": {"protocol": "grpc", "grpc_port": grpc_port}}))
    yield f"s3://{bucket}/models"
    server.terminate()
    server.wait(timeout=30)
    log.close()


class TaskInstanceStub:
    """Only xcom_push: the operator runs in-process here (non-deferrable); the DAG-run tests cover the lifecycle."""

    def __init__(self):
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_deploy_from_an_s3_repository_to_a_server_reading_it(s3_triton, tmp_path):
    from hybridflow.config import ReleaseConfig
    from hybridflow.operators.triton import TritonDeployOperator

    def run(export_dir: Path, release: ReleaseConfig) -> dict:
        operator = TritonDeployOperator(
            task_id="deploy", export_dir=str(export_dir), model_name="s3model", repository=s3_triton,
            triton_conn_id="triton_s3", storage_conn_id="storage_s3", deferrable=False, gate_requests=100,
            release=release)
        return operator.execute({"ti": TaskInstanceStub()})

    # This server has no guard in front (its connection names no guard_port): a progressive release, which needs
    # the guard to split traffic, is refused before anything is published, naming the fix.
    with pytest.raises(Exception, match="names no guard_port .* or use strategy: direct") as refused:
        run(make_export(tmp_path / "e0", 30), ReleaseConfig())
    assert type(refused.value).__name__ == "AirflowFailException"
    direct = ReleaseConfig(strategy="direct")

    assert run(make_export(tmp_path / "e1", 31), direct)["version"] == 1
    report = run(make_export(tmp_path / "e2", 32), direct)
    assert (report["version"], report["previous_version"], report["promoted"]) == (2, 1, True)
    assert report["latency"]["failed"] == 0
    hook = TritonHook("triton_s3")
    try:
        assert hook.ready_versions("s3model") == [2]
        assert hook.protocol == "grpc"
    finally:
        hook.close()
    repo = open_repository(s3_triton, "storage_s3")
    assert json.loads(repo.read("s3model", f"2/{RECORD_FILE}"))["status"] == "promoted"
    assert "versions: [ 2 ]" in repo.read_config("s3model")
