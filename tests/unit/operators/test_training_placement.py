"""The Slurm operators on either side of the placement, by tables: a job asking for no GPU runs on its CPUs
(CUDA_VISIBLE_DEVICES empty where asked) and its training result says "no GPU allocated (cpu placement)" instead
of judging GPU utilization; a GPU job is unchanged."""

from __future__ import annotations

import json

import pytest
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.operators.training import DeepSpeedTrainingOperator
from hybridflow.utils.slurm_jobs import SlurmJobStatus


@pytest.mark.parametrize("gpus, ranks, hide, side, env", [
    (0, 2, True, "cpu", {"CUDA_VISIBLE_DEVICES": "", "X": "1"}),
    ("0", "2", True, "cpu", {"CUDA_VISIBLE_DEVICES": "", "X": "1"}),  # rendered templates are text
    (0, 0, False, "cpu", {"X": "1"}),  # not asked: the job's environment as given
    (2, 2, True, "gpu", {"X": "1"}),  # Slurm binds each rank its GPU
    ("1", "1", True, "gpu", {"X": "1"}),
], ids=["cpu-ranks", "cpu-ranks-text", "cpu-not-hidden", "gpu", "gpu-text"])
def test_slurm_operator_placement_side_and_hidden_gpus(gpus, ranks, hide, side, env):
    op = SlurmSubmitOperator(task_id="job", command=["python", "x.py"], partition="p", log_dir="/l",
                             gpus_per_node=gpus, ranks_per_node=ranks, env={"X": "1"},
                             hide_gpus_without_gres=hide)
    spec = op.build_spec("hf-job")
    assert op.placement_side == side and dict(spec.env) == env
    assert (spec.gpus_per_node, spec.ranks_per_node) == (int(gpus), int(ranks))


def test_training_operator_hides_unallocated_gpus_by_default():
    op = DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir="/r", python="/py", jobs_dir="/jobs",
                                   partition="cpu", gpus_per_node=0, ranks_per_node=2)
    assert op.hide_gpus_without_gres and op.build_spec("hf-train").env == {"CUDA_VISIBLE_DEVICES": ""}


class FakeHook:
    def __init__(self, metrics: dict):
        self.metrics = metrics

    def read_text(self, path: str) -> str:
        return json.dumps(self.metrics)

    def tail(self, path: str, lines: int = 50) -> str:
        return ""

    def efficiency(self, job_id: str) -> dict:
        return {"job_id": job_id, "runs": 1, "requeues": 0, "queue_wait_s": 2.0, "elapsed_s": 1800}


@pytest.mark.parametrize("partition, gpus, tres, verdict, gpu_hours, fragment", [
    ("cpu", 0, {"cpu": "4", "node": "1"}, "no_gpu", 0.0, "no GPU allocated (cpu placement)"),
    ("gpu-training", 2, {"cpu": "4", "gres/gpu": "2"}, "not_measured", 1.0, "1.000 GPU-hours allocated"),
], ids=["cpu", "gpu"])
def test_training_result_by_placement(partition, gpus, tres, verdict, gpu_hours, fragment):
    op = DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir="/r", python="/py", jobs_dir="/jobs",
                                   partition=partition, gpus_per_node=gpus, ranks_per_node=2)
    op.__dict__["hook"] = FakeHook({"step": 10, "gpu": {"gpu_available": False, "reason": "nvidia-smi not found"}})
    status = SlurmJobStatus(job_id="7", name="hf-train", state="COMPLETED", source="sacct", exit_code=0,
                            elapsed_s=1800.0, alloc_tres=tres)
    result = op._finish(status)
    assert (result["partition"], result["placement_side"]) == (partition, "cpu" if gpus == 0 else "gpu")
    assert result["utilization"]["verdict"] == verdict and result["utilization"]["gpu_hours"] == gpu_hours
    assert fragment in result["utilization"]["message"]
    assert result["efficiency"]["job_id"] == "7" and result["efficiency"]["queue_wait_s"] == 2.0


class UnreadableAccounting(FakeHook):
    def efficiency(self, job_id: str) -> dict:
        from hybridflow.exceptions import SlurmConnectionError

        raise SlurmConnectionError("sacct on login:22 failed (exit 1): slurmdbd: Connection refused")


def test_accounting_that_cannot_be_read_leaves_the_job_succeeded_and_says_why():
    op = SlurmSubmitOperator(task_id="job", command=["true"], partition="p", log_dir="/l")
    op.__dict__["hook"] = UnreadableAccounting({})
    status = SlurmJobStatus(job_id="8", name="hf-job", state="COMPLETED", source="sacct", exit_code=0,
                            elapsed_s=3.0, alloc_tres={"cpu": "1"})
    result = op._finish(status, handback={"log_tail": "", "recovery": []})
    assert result["state"] == "COMPLETED"
    assert result["efficiency"] == {"job_id": "8", "not_measured": {
        "all": "Slurm accounting was not read: sacct on login:22 failed (exit 1): slurmdbd: Connection refused"}}
