"""DeepSpeed training as a real Slurm job on the GPU partition, submitted over SSH, as the job user:
metrics and a verified checkpoint come back; the CPU placement runs its ranks without GRES; a requeue of the
running job resumes from its last checkpoint."""

from __future__ import annotations

import json
import textwrap
import time
import uuid
from pathlib import Path

import pytest


def test_training_deepspeed_job_on_slurm_completes_with_metrics_and_a_verified_checkpoint(run_dag, training_area,
                                                                                         stack, make_run_config):
    features, run_dir = training_area
    dag_id = f"t_train_{uuid.uuid4().hex[:6]}"
    source = textwrap.dedent(f'''
        from datetime import datetime
        from airflow.sdk import DAG
        from hybridflow.operators.training import DeepSpeedTrainingOperator
        with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
            DeepSpeedTrainingOperator(
                task_id="train", run_config={make_run_config(features)!r}, run_dir="{run_dir}",
                python="{stack["HYBRIDFLOW_CLUSTER_PYTHON"]}", jobs_dir="{stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"]}",
                partition="gpu-training", gpus_per_node=1, cpus_per_task=2, time_limit=10, poll_interval_s=3,
                retries=0,
            )
    ''')
    result = run_dag(source, dag_id)
    assert result["state"] == "success", result["log"][-4000:]
    returned = result["tasks"]["train"]["xcom"]["return_value"]
    assert returned["state"] == "COMPLETED"
    assert returned["metrics"]["auc"] > 0.65
    assert returned["utilization"]["verdict"] == "not_measured"  # no GPU here: said so, not faked
    assert "nvidia-smi" in returned["utilization"]["message"]
    assert returned["utilization"]["gpu_hours"] > 0  # the allocation still cost GPU time
    # where the job's allocated time went (rank 0's phases against Slurm's elapsed), left for the ledger too
    split = returned["time_split"]
    assert {"training_steps", "data_loading", "rendezvous", "checkpoint_writes", "evaluation", "waiting"} <= set(
        split["shares"]) and split["shares"]["training_steps"] > 0
    # the phases and the rest make the whole job (Slurm counts whole seconds of a ~20-s job)
    assert sum(split["shares"].values()) == pytest.approx(1.0, abs=0.1)
    from hybridflow.config import pipeline_config

    left = json.loads((Path(pipeline_config().storage.layout.utilization_jobs) / f"{returned['job_id']}.json")
                      .read_text())
    assert left["shares"] == split["shares"]

    from hybridflow.sensors.checkpoint import CheckpointSensor

    checkpoint = CheckpointSensor(task_id="c", checkpoint_root=f"{run_dir}/checkpoints", min_step=120).poke({})
    assert checkpoint.is_done and checkpoint.xcom_value["step"] == 120
    assert (Path(run_dir) / "export" / "model.pt").stat().st_size > 0
    owner = Path(run_dir, "metrics.json").owner()
    assert owner == "mlops"  # the job ran as the unprivileged job user


def test_training_on_the_cpu_partition_asks_for_no_gpu_and_runs_its_ranks_on_cpus(run_dag, training_area, stack,
                                                                                  make_run_config, slurm):
    """The CPU placement as the nightly DAG renders it (partition cpu, 0 GPUs per node, `gpus` ranks per node): no
    GRES in the allocation, two CPU ranks (gloo) on one node, and the result says no GPU was allocated instead of
    judging GPU utilization."""
    features, run_dir = training_area
    dag_id = f"t_train_cpu_{uuid.uuid4().hex[:6]}"
    source = textwrap.dedent(f'''
        from datetime import datetime
        from airflow.sdk import DAG
        from hybridflow.operators.training import DeepSpeedTrainingOperator
        with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
            DeepSpeedTrainingOperator(
                task_id="train", run_config={make_run_config(features, max_steps=40)!r}, run_dir="{run_dir}",
                python="{stack["HYBRIDFLOW_CLUSTER_PYTHON"]}", jobs_dir="{stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"]}",
                partition="cpu", gpus_per_node="0", ranks_per_node="2", cpus_per_task=2, time_limit=10,
                poll_interval_s=2, retries=0,
            )
    ''')
    result = run_dag(source, dag_id)
    assert result["state"] == "success", result["log"][-4000:]
    returned = result["tasks"]["train"]["xcom"]["return_value"]
    assert returned["state"] == "COMPLETED" and "to partition cpu (no GPU)" in result["log"]
    assert "gres/gpu" not in returned["alloc_tres"] and returned["alloc_tres"]["cpu"] == "4"
    assert (returned["partition"], returned["placement_side"]) == ("cpu", "cpu")
    assert returned["utilization"]["verdict"] == "no_gpu" and returned["utilization"]["gpu_hours"] == 0.0
    assert returned["utilization"]["message"].startswith("no GPU allocated (cpu placement)")
    assert returned["metrics"]["world_size"] == 2 and returned["metrics"]["step"] == 40
    accounting = slurm.run(["sacct", "-X", "-n", "-P", "-j", returned["job_id"], "--format=Partition,AllocTRES"])
    partition, tres = accounting.stdout.strip().splitlines()[0].split("|")
    assert partition == "cpu" and "gres/gpu" not in tres, accounting.stdout


def test_training_requeue_of_the_running_job_resumes_from_its_last_checkpoint(training_area, stack, make_run_config):
    from hybridflow.operators.training import DeepSpeedTrainingOperator
    from hybridflow.utils.slurm import deterministic_job_name, render_sbatch_script

    features, run_dir = training_area
    op = DeepSpeedTrainingOperator(
        # long enough that the requeue meets a running job: the tiny preset's 400 steps now train in about a second,
        # less than one progress poll (the small preset at batch 256 takes ~10 s for 3000 steps here)
        task_id="train", run_config=make_run_config(features, max_steps=3000, batch_size=256, model={"preset": "small"},
                                                    checkpoint_every_steps=100), run_dir=run_dir,
        python=stack["HYBRIDFLOW_CLUSTER_PYTHON"], jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"],
        partition="gpu-training", gpus_per_node=1, cpus_per_task=2, time_limit=10,
    )
    hook = op.hook
    hook.run(["mkdir", "-p", "--", f"{run_dir}/logs"])
    hook.write_text(f"{run_dir}/config.json", json.dumps({**op.run_config, "run_dir": run_dir}))
    job_id = hook.submit(render_sbatch_script(op.build_spec(deterministic_job_name("t", "requeue", uuid.uuid4().hex))))
    try:
        deadline = time.monotonic() + 180
        progress = {}
        while time.monotonic() < deadline and (progress.get("last_checkpoint_step") or 0) < 100:
            time.sleep(1)
            progress = json.loads(hook.read_text(f"{run_dir}/progress.json") or "{}")
        checkpoint_before = progress["last_checkpoint_step"]
        assert progress.get("state") != "completed", f"the job finished before the requeue: {progress}"
        assert hook.run(["scontrol", "requeue", job_id]).returncode == 0

        status = hook.status(job_id)
        while not status.final(requeue_enabled=True) and time.monotonic() < deadline + 240:
            time.sleep(2)
            status = hook.status(job_id)
        assert status.state == "COMPLETED", status
        assert status.restarts == 1
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert metrics["step"] == 3000  # the same end as an uninterrupted run
        assert metrics["restarts"] == 1
        # lost work is at most one checkpoint interval: it resumed at or after the checkpoint seen before
        assert checkpoint_before <= metrics["resumed_from_step"] < 3000
    finally:
        hook.cancel(job_id)
        hook.close()
