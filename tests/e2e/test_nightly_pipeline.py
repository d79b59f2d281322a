"""The nightly pipeline on the running local Airflow: a scheduled-style run through every stage, and a backfill
that recomputes features and scores without training. Dates are far from the demo's so the two do not meet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from airflow_api import task_states, wait_for_run, xcom
from airflow_session import local_airflow
from demo import ensure_fresh_preflight
from helpers.mlflow_server import Mlflow
from helpers.partitions import manifest
from helpers.stack import LOCALSTACK, REPO
from helpers.waiting import wait_until
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.triton import TritonHook
from stack.airflow import orphaned_executor_workers

DAG = "nightly_training"
DS = "2025-06-03"
# Both runs take 2 ranks x the same micro-batch over the same rows, each rank the same slice of every global batch:
# the same training up to the order in which gloo sums fp32 gradients.
SAME_TRAINING_AUC_TOLERANCE = 1e-3


@pytest.fixture(scope="module", autouse=True)
def paused_afterwards(api):
    """Pause the DAG when this module ends: the runs here unpause it, and a scheduled run of the suite's own
    (training, deploying) must not run beside the tests that follow."""
    yield
    api.patch(f"/api/v2/dags/{DAG}", {"is_paused": True})


def storage(stack) -> Path:
    return Path(stack["HYBRIDFLOW_STORAGE_ROOT"])


def unique_logical_date(ds: str) -> str:
    now = datetime.now(UTC)
    return f"{ds}T{now:%H:%M:%S.%f}+00:00"


def trigger(api, conf: dict, ds: str) -> str:
    api.patch(f"/api/v2/dags/{DAG}", {"is_paused": False})
    return api.post(f"/api/v2/dags/{DAG}/dagRuns", {"logical_date": unique_logical_date(ds), "conf": conf})[
        "dag_run_id"]


def slurm_jobs_named(prefix: str) -> list[str]:
    hook = SlurmHook()
    try:
        out = hook.run(["sacct", "-X", "-n", "-P", "--starttime=now-1days", "--format=JobID,JobName%200"])
    finally:
        hook.close()
    return [line for line in out.stdout.splitlines() if line.split("|")[1].startswith(prefix)]


def service_pids() -> dict[str, int | None]:
    rows = subprocess.run([*LOCALSTACK, "status", "--json"], capture_output=True, text=True, check=True).stdout
    return {row["service"]: row["pid"] for row in json.loads(rows)}


def sigkill(services: list[str]) -> None:
    """SIGKILL each service's process, as a crash or the OOM killer would, and wait until it is gone."""
    pids = service_pids()
    for service in services:
        os.kill(pids[service], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pids[s]}").exists() for s in services) and time.monotonic() < deadline:
        time.sleep(0.1)


def make_up() -> str:
    """What on-call runs: `make up`, once."""
    done = subprocess.run(["make", "up"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"make up failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def wait_for_task(api, run_id: str, task_id: str, states: set[str], timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = task_states(api, DAG, run_id).get(task_id)
        if state in states:
            return state
        assert state not in ("failed", "upstream_failed"), task_states(api, DAG, run_id)
        time.sleep(1)
    raise AssertionError(f"{task_id} of {run_id} never became {states}: {task_states(api, DAG, run_id)}")


def rank_log(run_dir: Path) -> str:
    return "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*.err")))


@pytest.fixture(scope="module")
def one_node_run(api, stack) -> dict:
    """The module's one shared set-up: a nightly run on 1 node x 2 ranks (two GPUs of one node) through every
    stage to Triton. It leaves a model of record, which the backfill scores with, and the metrics the 2-node run
    must reproduce. Any test of this module may run alone: it gets this run through the fixture."""
    root = storage(stack)
    # Training refuses a missing or stale all-reduce preflight of its topology (a fresh stack has none): run it as
    # `make demo` does.
    ensure_fresh_preflight(local_airflow(), str(root), timeout_s=600, nodes=1, gpus_per_node=2)
    run_id = trigger(api, {"model_preset": "small", "device": "gpu", "deploy": "always", "nodes": 1,
                           "gpus_per_node": 2}, DS)
    state = wait_for_run(api, DAG, run_id, timeout_s=900, poll_s=2)
    states = task_states(api, DAG, run_id)
    assert state == "success", f"the shared 1 x 2 nightly run {run_id} did not succeed: {states}"
    return {"run_id": run_id, "states": states, "train": xcom(api, DAG, run_id, "training.train")}


def test_nightly_run_produces_every_stages_output(api, stack, one_node_run):
    """One node x 2 ranks (two GPUs of one node), every stage through to Triton."""
    ds = DS
    root = storage(stack)
    run_id, states = one_node_run["run_id"], one_node_run["states"]
    # deploy=always promotes on its own: only the asking (deploy=ask) is skipped
    asking = {"deploy.approve_release": "skipped", "deploy.finish_release": "skipped"}
    assert {k: v for k, v in states.items() if v != "success"} == asking, "a stage was skipped or failed"

    features = manifest(root, "features", ds)
    quarantine = manifest(root, "quarantine", ds)
    assert features["row_count"] > 0 and features["quarantine"]["rows"] == quarantine["row_count"] > 0
    gate = xcom(api, DAG, run_id, "quality.quality_gate")
    assert gate["summary"]["failed"] == 0 and gate["figures"]["raw_rows"] == features["input"]["raw_rows"]

    train = one_node_run["train"]
    assert train["state"] == "COMPLETED" and train["alloc_tres"]["gres/gpu"] == "2"
    assert train["metrics"]["auc"] > 0.55 and train["metrics"]["step"] > 0
    assert train["metrics"]["world_size"] == 2 and train["metrics"]["nodes"] == 1
    assert sorted(train["metrics"]["ranks"]) == ["0@gpu-node-01", "1@gpu-node-01"]
    run_dir = Path(train["run_dir"])
    log = rank_log(run_dir)
    assert "rank0@gpu-node-01" in log and "ranks: 0@gpu-node-01, 1@gpu-node-01" in log
    step_dirs = sorted((run_dir / "checkpoints").glob("step_*"))
    assert step_dirs and (step_dirs[-1] / "MANIFEST.json").is_file()
    # Exactly one training job for this run, found by its deterministic name.
    assert len(slurm_jobs_named(train["name"])) == 1

    decision = xcom(api, DAG, run_id, "evaluation.champion_challenger")
    registry = Mlflow(stack)
    registered = registry.model_version("propensity", decision["registered_version"])
    tags = {t["key"]: t["value"] for t in registered["tags"]}
    assert registered["run_id"] == decision["mlflow_run_id"] == train["mlflow"]["run_id"]  # lineage to its run
    assert tags["hybridflow.airflow_run_id"] == run_id and tags["hybridflow.decision"] == decision["decision"]
    assert "challenger" in registered["aliases"]
    champion = registry.alias("propensity", "champion")
    if decision["promoted_version"] is not None:
        assert champion["version"] == str(decision["promoted_version"]) == registered["version"]
    else:
        assert decision["decision"] == "keep_champion" and "keep the champion" in decision["reason"]
        assert champion["version"] != registered["version"]

    predictions = manifest(root, "predictions", ds)
    assert predictions["row_count"] == features["row_count"]
    table = pq.read_table(root / "predictions" / f"ds={ds}", columns=["model_version", "score"])
    assert set(table.column("model_version").to_pylist()) == {f"v{champion['version']}"}
    scores = table.column("score").to_numpy()
    assert ((scores >= 0) & (scores <= 1)).all()

    deploy = xcom(api, DAG, run_id, "deploy.deploy_model")
    # The gate passed: no failed request, and no evidence (the p99's lower bound) of a p99 over the SLO.
    latency = deploy["latency"]
    assert latency["failed"] == 0 and latency["p99_low_ms"] <= deploy["slo_p99_ms"], latency
    assert latency["measured"] == latency["requests"] - latency["warmup"] and latency["warmup"] == 20
    assert latency["decision"].startswith("pass: p99 ") and " 95% bounds [" in latency["decision"], latency
    assert deploy["smoke"]["max_abs_error"] <= deploy["smoke"]["atol"]
    hook = TritonHook()
    assert hook.ready_versions(deploy["model"]) == [deploy["version"]]
    champion_dir = {t["key"]: t["value"] for t in champion["tags"]}["hybridflow.model_dir"]
    champion_smoke = json.loads((Path(champion_dir) / "smoke.json").read_text())
    served = hook.infer(deploy["model"], np.asarray(champion_smoke["inputs"], dtype=np.float32))
    assert np.allclose(served.reshape(-1), np.asarray(champion_smoke["outputs"]).reshape(-1), atol=1e-5)
    # Both ways: the served Triton version's record names its registry version, and that version (the champion)
    # names the Triton version, what the deploy decided and the partition it scored.
    champion_uri = f"models:/propensity/{champion['version']}"
    served_record = Path(deploy["repository"].removeprefix("file://")) / deploy["model"] / str(deploy["version"])
    assert json.loads((served_record / "hybridflow.json").read_text())["model_uri"] == champion_uri
    assert deploy["model_uri"] == champion_uri
    recorded = xcom(api, DAG, run_id, "report.record_in_registry")
    assert recorded["version_uri"] == champion_uri and set(recorded) >= {"scoring", "deploy"}, recorded
    champion_tags = {t["key"]: t["value"] for t in registry.alias("propensity", "champion")["tags"]}
    assert champion_tags["hybridflow.triton_version"] == str(deploy["version"])
    assert f"Triton {deploy['model']} version {deploy['version']} promoted" in champion_tags["hybridflow.deploy"]
    assert (champion_tags["hybridflow.last_scored_ds"], champion_tags["hybridflow.last_scored_rows"],
            champion_tags["hybridflow.last_scored_by"]) == (ds, str(predictions["row_count"]), run_id)

    report = xcom(api, DAG, run_id, "report.write_report")
    written = json.loads(Path(report["json"]).read_text())
    assert written["run_id"] == run_id and Path(report["html"]).is_file()
    record = written["sections"]["record"]["figures"]  # the report links its MLflow run and model version
    assert record["run_url"]["value"] == train["mlflow"]["url"] and record["run_url"]["value"] in Path(
        report["html"]).read_text()
    assert record["model_version"]["value"] == str(decision["registered_version"])
    nights = written["sections"]["record"]["history"]["nights"]  # the "last 30 nights", read from MLflow
    assert {night["ds"]: night["auc"] for night in nights}[ds] == pytest.approx(train["metrics"]["auc"], abs=1e-6)
    assert any(chart.endswith("loss_curve.png") for chart in report["charts"])
    # No GPU here, and a fresh stack has nothing serving before this deploy: both said, never invented.
    allowed = {"training.mean_gpu_utilization_pct", "training.gpu_utilization_per_gpu"}
    if deploy.get("previous_version") is None:
        allowed.add("deploy.previous_version")
    if deploy.get("previous_version") in (None, deploy["version"]):  # nothing to release against: no steps
        assert deploy["release"] is None, deploy["release"]
        allowed.add("deploy.release_decision")
    if decision["champion"] is None:  # the first model: there was no champion to compare with
        allowed |= {"evaluation.champion_version", "evaluation.champion_auc", "evaluation.champion_log_loss"}
    assert {item["figure"] for item in written["not_measured"]} <= allowed, written["not_measured"]


def test_nightly_run_on_two_nodes_trains_with_one_rank_on_each_through_a_control_plane_crash(api, stack, one_node_run):
    """2 nodes x 1 rank, same date: each rank on its own node, the same holdout metrics as the 1 x 2 run.

    The control plane comes back (issue 24): while training is deferred, every Airflow component (scheduler,
    triggerer, dag-processor, api-server) and slurmctld are SIGKILLed, and PostgreSQL (Airflow's metadata DB) while
    scoring runs; one `make up` each time. The run still succeeds with exactly one training job."""
    one_node = one_node_run["train"]["metrics"]
    root = storage(stack)
    ensure_fresh_preflight(local_airflow(), str(root), timeout_s=600, nodes=2, gpus_per_node=1)
    run_id = trigger(api, {"model_preset": "small", "device": "gpu", "train": "always", "deploy": "never", "nodes": 2,
                           "gpus_per_node": 1}, DS)
    wait_for_task(api, run_id, "training.train", {"deferred"})
    job_id = xcom(api, DAG, run_id, "training.train", key="slurm_job_id")
    # slurmctld saves its state in batches (within ~5 s): killed sooner after the allocation, it forgets it
    # (include/runbooks/training.md#controller-restarted). This kills it once the job's start was saved: 8 s into
    # the job, or once it ended (the small preset's 155 steps take ~7 s on two ranks; the task is still deferred
    # either way, and the trigger must learn the end from the restarted controller or from accounting).
    hook = SlurmHook()

    def start_saved() -> bool:
        status = hook.status(job_id)
        return status is not None and ((status.elapsed_s or 0) >= 8 or status.final(requeue_enabled=True))

    try:
        wait_until(f"job {job_id} running 8 s or ended", start_saved, timeout_s=120)
    finally:
        hook.close()
    control_plane = ["airflow-scheduler", "airflow-triggerer", "airflow-dag-processor", "airflow-api-server",
                     "slurmctld"]
    killed_at = time.monotonic()
    sigkill(control_plane)
    brought_back = make_up()
    back_s = time.monotonic() - killed_at
    for service in control_plane:
        assert f"{service}: already up" not in brought_back, brought_back
    assert not orphaned_executor_workers()  # the killed scheduler's idle workers are not left running
    assert wait_for_task(api, run_id, "scoring.score_batch", {"running", "success"}) == "running", (
        "scoring ended before PostgreSQL could be killed under it")
    sigkill(["postgres"])
    assert "postgres: starting" in make_up()
    state = wait_for_run(api, DAG, run_id, timeout_s=900, poll_s=2)
    assert state == "success", task_states(api, DAG, run_id)
    print(f"RELIABILITY control_plane_sigkill back_s={back_s:.0f} run={run_id}")
    gate = xcom(api, DAG, run_id, "preflight.allreduce_preflight")
    assert "over 2 ranks" in gate

    train = xcom(api, DAG, run_id, "training.train")
    assert train["alloc_tres"]["gres/gpu"] == "2" and train["alloc_tres"]["node"] == "2"
    metrics = train["metrics"]
    assert metrics["world_size"] == 2 and metrics["nodes"] == 2
    assert sorted(metrics["ranks"]) == ["0@gpu-node-01", "1@gpu-node-02"]
    log = rank_log(Path(train["run_dir"]))
    assert "ranks: 0@gpu-node-01, 1@gpu-node-02" in log
    assert len(slurm_jobs_named(train["name"])) == 1  # the crash resubmitted nothing
    assert metrics["step"] == one_node["step"]
    assert abs(metrics["auc"] - one_node["auc"]) <= SAME_TRAINING_AUC_TOLERANCE
    assert 0 < metrics["allreduce_share_in_job"] < 1


def test_backfill_recomputes_each_day_without_training(api, stack, one_node_run):
    """A backfill over 2 days, both at once (max_active_runs 2): a feature and a prediction partition per day,
    scored with the model of record (the shared run leaves one), no job on the GPU partition. Rerunning a date
    replaces its partitions (a second backfill would find them complete)."""
    root = storage(stack)
    champion = Mlflow(stack).alias("propensity", "champion")
    assert champion, "the shared nightly run left no model of record"
    days = ["2025-07-01", "2025-07-02"]
    before = len(slurm_jobs_named(f"hf-{DAG}-training.train-backfill"))
    backfill = api.post("/api/v2/backfills", {
        "dag_id": DAG, "from_date": f"{days[0]}T00:00:00Z", "to_date": f"{days[-1]}T23:59:59Z",
        "run_backwards": False, "dag_run_conf": {}, "reprocess_behavior": "completed", "max_active_runs": 2,
    })
    assert backfill["dag_id"] == DAG
    runs = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        runs = [r for r in api.get(f"/api/v2/dags/{DAG}/dagRuns?limit=100&order_by=-logical_date")["dag_runs"]
                if r["run_type"] == "backfill" and (r["logical_date"] or "")[:10] in days]
        if len(runs) == len(days) and all(r["state"] in ("success", "failed") for r in runs):
            break
        time.sleep(3)
    assert sorted(r["state"] for r in runs) == ["success"] * len(days), runs
    for run in runs:
        states = task_states(api, DAG, run["dag_run_id"])
        assert states["training.train"] == "skipped" and states["scoring.score_batch"] == "success"
    for ds in days:
        features = manifest(root, "features", ds)
        assert manifest(root, "predictions", ds)["row_count"] == features["row_count"]
        versions = pq.read_table(root / "predictions" / f"ds={ds}", columns=["model_version"]).column(0)
        assert set(versions.to_pylist()) == {f"v{champion['version']}"}
    assert len(slurm_jobs_named(f"hf-{DAG}-training.train-backfill")) == before
