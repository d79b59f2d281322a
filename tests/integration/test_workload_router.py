"""The workload_router DAG through Airflow's task lifecycle on the real local stack: Spark on local[2], the
Slurm GPU partition over SSH, Triton; and refusals that start nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.hooks.slurm import SlurmHook
from hybridflow.utils.routing import run_dir_for
from hybridflow.utils.slurm import deterministic_job_name

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "workload_router"
SOURCE = (REPO / "dags" / f"{DAG_ID}.py").read_text()
RUNNER = Path(__file__).with_name("airflow_runner.py")
VALID_TYPES = "feature_engineering, model_training, batch_inference, realtime_inference"
RUN_TASKS = ("run_on_cpu_spark", "run_on_gpu_slurm", "run_on_cpu_slurm", "serve_on_triton")


def states(result: dict) -> dict[str, str]:
    return {task_id: task["state"] for task_id, task in result["tasks"].items()}


def router_jobs(slurm: SlurmHook, run_id: str) -> list:
    """Every Slurm job either Slurm task of this DAG run submitted (looked up by its deterministic name)."""
    return [job for task_id in ("run_on_gpu_slurm.0", "run_on_cpu_slurm.0")
            for job in slurm.find_by_name(deterministic_job_name(DAG_ID, task_id, run_id))]


def remove_run_dir(slurm: SlurmHook, stack: dict, run_id: str) -> None:
    slurm.run(["rm", "-rf", "--", run_dir_for(stack["HYBRIDFLOW_STORAGE_ROOT"], run_id)])


def test_router_feature_engineering_runs_a_spark_job_on_the_cpu_side(run_dag):
    result = run_dag(SOURCE, DAG_ID, {"workload_type": "feature_engineering", "config": {"rows": 20000}})
    assert result["state"] == "success", result["log"][-4000:]
    decision = result["tasks"]["route"]["xcom"]["decision"]
    assert (decision["side"], decision["target"], decision["rule"]) == ("cpu", "spark", "default")
    assert states(result)["run_on_cpu_spark"] == "success"
    assert {states(result)[t] for t in RUN_TASKS[1:]} == {"skipped"}
    assert "Routing decision: feature_engineering -> cpu (spark): no measured profile given" in result["log"]
    assert "HEALTHCHECK master=local[2] sum=399980000 expected=399980000" in result["log"]


def test_router_model_training_completes_on_the_gpu_partition_with_one_gpu(run_dag, slurm, stack):
    result = run_dag(SOURCE, DAG_ID, {"workload_type": "model_training", "config": {"hidden_sizes": "64,32"}})
    try:
        assert result["state"] == "success", result["log"][-4000:]
        assert result["tasks"]["route"]["xcom"]["decision"]["target"] == "slurm_gpu"
        assert states(result)["run_on_gpu_slurm"] == "success"
        others = ("run_on_cpu_spark", "run_on_cpu_slurm", "serve_on_triton")
        assert {states(result)[t] for t in others} == {"skipped"}
        job_id = result["tasks"]["run_on_gpu_slurm"]["xcom"]["slurm_job_id"]
        accounted = slurm.run(["sacct", "-X", "-P", "-n", "-j", job_id,
                               "--format=State,Partition,AllocTRES,JobName"]).stdout.strip()
        state, partition, tres, name = accounted.split("|")
        assert (state, partition) == ("COMPLETED", "gpu-training")
        assert "gres/gpu=1" in tres.split(",")
        assert name == deterministic_job_name(DAG_ID, "run_on_gpu_slurm.0", result["run_id"])
        # the job really ran the training step the rules name, with the validated config field
        step = json.loads(slurm.read_text(
            f"{run_dir_for(stack['HYBRIDFLOW_STORAGE_ROOT'], result['run_id'])}/training_step.json"))
        assert step["slurm_job_id"] == job_id and step["model"]["hidden_sizes"] == [64, 32]
        assert step["world_size"] == 2
    finally:
        remove_run_dir(slurm, stack, result["run_id"])


def test_router_realtime_inference_checks_triton_and_records_the_decision(run_dag):
    result = run_dag(SOURCE, DAG_ID, {"workload_type": "realtime_inference", "profile": {"cpu_p99_ms": 12.5}})
    assert result["state"] == "success", result["log"][-4000:]
    served = result["tasks"]["serve_on_triton"]["xcom"]["return_value"]
    assert (served["decision"]["side"], served["decision"]["rule"]) == ("cpu", "cpu-meets-slo")
    assert served["triton"]["url"] and served["triton"]["models"] >= 0  # check_triton saw the server ready
    assert ("Realtime serving routed to cpu: realtime_inference -> cpu (triton): measured "
            "cpu_p99_ms=12.5 <= 50") in result["log"]


def test_router_dry_run_routes_and_starts_nothing(run_dag, slurm):
    result = run_dag(SOURCE, DAG_ID, {"workload_type": "model_training", "dry_run": True})
    assert result["state"] == "success", result["log"][-4000:]
    assert states(result)["route"] == "success"
    assert {states(result)[t] for t in RUN_TASKS} == {"skipped"}
    assert "dry run: model_training -> gpu (slurm_gpu)" in result["log"]
    assert router_jobs(slurm, result["run_id"]) == []


def test_router_unknown_type_is_refused_by_the_trigger_form_schema(isolated_airflow_env, slurm, tmp_path):
    """The params' enum refuses the run before any task starts, naming the valid types."""
    dag_file = Path(isolated_airflow_env["AIRFLOW__CORE__DAGS_FOLDER"]) / f"{DAG_ID}.py"
    dag_file.write_text(SOURCE)
    started = time.time()
    out = subprocess.run([sys.executable, str(RUNNER), str(dag_file), DAG_ID,
                          json.dumps({"workload_type": "quantum_annealing"})],
                         env=isolated_airflow_env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "RESULT " not in out.stdout
    assert "quantum_annealing" in out.stderr and "is not one of" in out.stderr
    for valid in VALID_TYPES.split(", "):
        assert valid in out.stderr
    recent = slurm.run(["sacct", "-X", "-P", "-n", "--starttime", time.strftime("%Y-%m-%dT%H:%M:%S",
                        time.localtime(started)), "--format=JobName"]).stdout
    assert f"hf-{DAG_ID}-" not in recent


def test_router_unknown_type_fails_the_route_task_clearly_even_past_the_schema(run_dag, slurm):
    """Defence in depth: with the form's enum bypassed, the route task itself refuses, once; nothing runs."""
    enum = "enum=list(rules.workload_types),"
    assert enum in SOURCE
    result = run_dag(SOURCE.replace(enum, ""), DAG_ID, {"workload_type": "model_training; rm -rf /"})
    assert result["state"] == "failed"
    assert states(result)["route"] == "failed" and result["tasks"]["route"]["try_number"] == 1
    assert "upstream_failed" in {states(result)[t] for t in RUN_TASKS}
    assert "success" not in {states(result)[t] for t in RUN_TASKS}
    assert (f"workload refused: workload_type 'model_training; rm -rf /' is not a known workload type; valid "
            f"types: {VALID_TYPES}") in result["log"]
    assert "Runbook: include/runbooks/workload-router.md" in result["log"]
    assert router_jobs(slurm, result["run_id"]) == []
