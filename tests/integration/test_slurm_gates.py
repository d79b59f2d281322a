"""Capacity and checkpoint gates against the real local Slurm, sshd and S3 endpoint."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from hybridflow.hooks.checkpoint import S3CheckpointStore, SshCheckpointStore, newest_complete
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.storage import StorageHook


@pytest.fixture
def all_gpus_taken(stack):
    """A job holding every GPU of the partition (all 8 on each of its nodes), cancelled at the end."""
    hook = SlurmHook()
    nodes = sum(int(n) for n in hook.run(["sinfo", "-h", "-p", "gpu-training", "-o", "%D"]).stdout.split())
    job_id = hook.submit(f"#!/bin/bash\n#SBATCH --partition=gpu-training\n#SBATCH --nodes={nodes}\n"
                         "#SBATCH --gres=gpu:8\n#SBATCH --output=/dev/null\nsleep 600\n")
    deadline = time.monotonic() + 30
    while hook.status(job_id).state != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    yield hook, job_id
    hook.cancel(job_id)
    hook.close()


def test_slurm_capacity_sensor_waits_while_gpus_are_taken_and_proceeds_when_freed(all_gpus_taken):
    from hybridflow.sensors.slurm import SlurmCapacitySensor

    hook, job_id = all_gpus_taken
    sensor = SlurmCapacitySensor(task_id="capacity", partition="gpu-training", gpus_per_node=1)
    assert sensor.poke({}) is False
    assert "gpu-node-01" in sensor.last_reason and "0/8 free" in sensor.last_reason
    hook.cancel(job_id)
    assert sensor.poke({}) is True


@pytest.mark.parametrize(
    "nodes, gpus_per_node, fragment",
    [(1, 9, "its largest node is gpu-node-02 with 8 GPU(s)"),
     (3, 1, "only 2 of its 2 node(s) have 1+ GPUs"),
     (3, 9, "its largest node is gpu-node-02 with 8 GPU(s)")],
    ids=["gpus-per-node", "nodes", "both"],
)
def test_slurm_capacity_refuses_at_once_what_the_partition_can_never_run(stack, nodes, gpus_per_node, fragment):
    """Nothing is held: waiting would not help, so the sensor fails on its first poke and the trigger ends at once."""
    from airflow.sdk.exceptions import AirflowFailException
    from hybridflow.sensors.slurm import SlurmCapacitySensor
    from hybridflow.triggers.slurm import SlurmCapacityTrigger

    sensor = SlurmCapacitySensor(task_id="capacity", partition="gpu-training", nodes=nodes,
                                 gpus_per_node=gpus_per_node)
    with pytest.raises(AirflowFailException, match="can never run in partition 'gpu-training'") as refused:
        sensor.poke({})
    assert fragment in str(refused.value) and "include/runbooks/capacity.md" in str(refused.value)

    trigger = SlurmCapacityTrigger(partition="gpu-training", gpus_per_node=gpus_per_node, nodes=nodes,
                                   ssh_conn_id="slurm_ssh", poke_interval_s=1, timeout_s=60)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "impossible" and fragment in event["reason"]


def test_training_operator_refuses_an_impossible_shape_before_submitting(stack):
    from airflow.sdk.exceptions import AirflowFailException
    from hybridflow.operators.training import DeepSpeedTrainingOperator

    run_dir = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/test-impossible-{uuid.uuid4().hex[:8]}"
    op = DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir=run_dir, python="python3",
                                   jobs_dir="/nowhere", partition="gpu-training", nodes=2, gpus_per_node=9)
    name = f"hf-test-impossible-{uuid.uuid4().hex[:8]}"  # unique: other jobs may start meanwhile
    hook = SlurmHook()
    try:
        with pytest.raises(AirflowFailException, match="not submitted: 2 node.s. x 9 GPU.s. can never run"):
            op._refuse_impossible_shape(op.build_spec(name))
        accounted = hook.run(["sacct", "-X", "-n", "-P", "--starttime=now-1hours", f"--name={name}",
                              "--format=JobID"]).stdout.split()
        queued = hook.run(["squeue", "-h", f"--name={name}", "-o", "%i"]).stdout.split()
        assert accounted == [] and queued == [], f"a job named {name} was submitted: {accounted or queued}"
    finally:
        hook.close()


def test_slurm_capacity_trigger_yields_ready_once_the_gpus_free_up(all_gpus_taken):
    """The deferrable path: the trigger's own async SSH connection (host key verified on port 2222)."""
    from hybridflow.triggers.slurm import SlurmCapacityTrigger

    hook, job_id = all_gpus_taken
    trigger = SlurmCapacityTrigger(partition="gpu-training", gpus_per_node=2, nodes=1, ssh_conn_id="slurm_ssh",
                                   poke_interval_s=1, timeout_s=120)
    freer = threading.Timer(4, lambda: SlurmHook().cancel(job_id))
    freer.start()

    async def first_event():
        async for event in trigger.run():
            return event.payload

    started = time.monotonic()
    event = asyncio.run(first_event())
    assert event["status"] == "ready"
    assert time.monotonic() - started >= 3  # it really waited for the job to go


def test_slurm_capacity_trigger_times_out_with_the_reason(all_gpus_taken):
    from hybridflow.triggers.slurm import SlurmCapacityTrigger

    trigger = SlurmCapacityTrigger(partition="gpu-training", gpus_per_node=1, nodes=1, ssh_conn_id="slurm_ssh",
                                   poke_interval_s=1, timeout_s=2)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "timeout"
    assert "0/8 free" in event["reason"]


def write_checkpoint(root: Path, step: int, files: dict[str, bytes], manifest: bool = True, corrupt: str = ""):
    step_dir = root / f"step_{step}"
    step_dir.mkdir(parents=True)
    entries = []
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    if manifest:
        (step_dir / "MANIFEST.json").write_text(json.dumps(
            {"format": "hybridtrain-checkpoint/1", "tag": f"step_{step}", "step": step, "epoch": 0,
             "files": entries, "metrics": {"loss": 1.0 / step}}))
    if corrupt == "truncate":
        (step_dir / next(iter(files))).write_bytes(next(iter(files.values()))[:3])
    elif corrupt == "flip":
        data = bytearray(next(iter(files.values())))
        data[0] ^= 0xFF
        (step_dir / next(iter(files))).write_bytes(bytes(data))
    return step_dir


@pytest.fixture
def checkpoint_tree(stack):
    """step_10 complete; step_20 without a manifest; step_30 truncated; step_40 with a flipped byte."""
    root = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "checkpoints" / f"test-{uuid.uuid4().hex[:8]}"
    payload = {"model.pt": b"weights-" * 100, "optim.pt": b"state-" * 50}
    write_checkpoint(root, 10, payload)
    write_checkpoint(root, 20, payload, manifest=False)
    write_checkpoint(root, 30, payload, corrupt="truncate")
    write_checkpoint(root, 40, payload, corrupt="flip")
    yield root
    shutil.rmtree(root)


def assert_newest_complete_is_step_10(verdict, rejected):
    assert verdict is not None and verdict.step == 10
    reasons = {bad.step: " ".join(bad.problems) for bad in rejected}
    assert set(reasons) == {20, 30, 40}
    assert "no MANIFEST.json" in reasons[20]
    assert "truncated" in reasons[30]
    assert "sha256" in reasons[40]


def test_checkpoint_over_ssh_rejects_missing_truncated_and_corrupt(checkpoint_tree):
    hook = SlurmHook()
    try:
        assert_newest_complete_is_step_10(*newest_complete(SshCheckpointStore(str(checkpoint_tree), hook)))
    finally:
        hook.close()


def test_checkpoint_in_s3_rejects_missing_truncated_and_corrupt(checkpoint_tree):
    hook = StorageHook("storage_s3")
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    hook.client.create_bucket(Bucket=bucket)
    for path in checkpoint_tree.rglob("*"):
        if path.is_file():
            hook.upload_file(str(path), bucket, f"runs/r1/checkpoints/{path.relative_to(checkpoint_tree)}")
    assert_newest_complete_is_step_10(*newest_complete(S3CheckpointStore(f"s3://{bucket}/runs/r1/checkpoints", hook)))


def test_checkpoint_sensor_pokes_until_a_complete_checkpoint_exists(stack, tmp_path):
    from hybridflow.sensors.checkpoint import CheckpointSensor

    root = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "checkpoints" / f"test-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    try:
        sensor = CheckpointSensor(task_id="ckpt", checkpoint_root=str(root), min_step=50)
        write_checkpoint(root, 10, {"model.pt": b"x" * 10})
        assert sensor.poke({}).is_done is False  # step 10 is older than min_step
        write_checkpoint(root, 60, {"model.pt": b"y" * 10})
        result = sensor.poke({})
        assert result.is_done is True
        assert result.xcom_value["step"] == 60 and result.xcom_value["path"].endswith("/step_60")
    finally:
        shutil.rmtree(root)


def test_checkpoint_trigger_waits_for_the_manifest_then_yields_the_checkpoint(checkpoint_tree):
    """The deferrable path: step_20 gets its manifest while the trigger polls, and becomes the newest complete."""
    from hybridflow.triggers.checkpoint import CheckpointTrigger

    trigger = CheckpointTrigger(checkpoint_root=str(checkpoint_tree), min_step=20, verify_hashes=True,
                                ssh_conn_id="slurm_ssh", storage_conn_id="storage_s3", poke_interval_s=1,
                                timeout_s=60)
    step_dir = checkpoint_tree / "step_20"

    def publish_manifest():
        entries = [{"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                   for p in sorted(step_dir.iterdir())]
        (step_dir / "MANIFEST.json").write_text(json.dumps({"step": 20, "files": entries, "metrics": {"loss": 0.5}}))

    threading.Timer(3, publish_manifest).start()

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "found" and event["step"] == 20
    assert event["metrics"] == {"loss": 0.5}
