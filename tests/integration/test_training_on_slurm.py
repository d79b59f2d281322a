"""DeepSpeed training as a real Slurm job on the GPU partition, submitted over SSH, as the job user:
metrics and a verified checkpoint come back; a requeue of the running job resumes from its last checkpoint."""

from __future__ import annotations

import json
import textwrap
import time
import uuid
from pathlib import Path


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

    from hybridflow.sensors.checkpoint import CheckpointSensor

    checkpoint = CheckpointSensor(task_id="c", checkpoint_root=f"{run_dir}/checkpoints", min_step=120).poke({})
    assert checkpoint.is_done and checkpoint.xcom_value["step"] == 120
    assert (Path(run_dir) / "export" / "model.pt").stat().st_size > 0
    owner = Path(run_dir, "metrics.json").owner()
    assert owner == "mlops"  # the job ran as the unprivileged job user


def test_training_requeue_of_the_running_job_resumes_from_its_last_checkpoint(training_area, stack, make_run_config):
    from hybridflow.operators.training import DeepSpeedTrainingOperator
    from hybridflow.utils.slurm import deterministic_job_name, render_sbatch_script

    features, run_dir = training_area
    op = DeepSpeedTrainingOperator(
        task_id="train", run_config=make_run_config(features, max_steps=400), run_dir=run_dir,
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
        while time.monotonic() < deadline and (progress.get("last_checkpoint_step") or 0) < 40:
            time.sleep(1)
            progress = json.loads(hook.read_text(f"{run_dir}/progress.json") or "{}")
        checkpoint_before = progress["last_checkpoint_step"]
        assert hook.run(["scontrol", "requeue", job_id]).returncode == 0

        status = hook.status(job_id)
        while not status.final(requeue_enabled=True) and time.monotonic() < deadline + 240:
            time.sleep(2)
            status = hook.status(job_id)
        assert status.state == "COMPLETED", status
        assert status.restarts == 1
        metrics = json.loads(hook.read_text(f"{run_dir}/metrics.json"))
        assert metrics["step"] == 400  # the same end as an uninterrupted run
        assert metrics["restarts"] == 1
        # lost work is at most one checkpoint interval: it resumed at or after the checkpoint seen before
        assert checkpoint_before <= metrics["resumed_from_step"] < 400
    finally:
        hook.cancel(job_id)
        hook.close()
