"""Tracking one Slurm job: statuses from scontrol/sacct answers and the reattach rule, by tables."""

from __future__ import annotations

import pytest
from hybridflow.utils.progress import describe_progress
from hybridflow.utils.slurm_jobs import (
    SlurmJobStatus,
    job_ids_by_name,
    job_to_reattach,
    scontrol_says_unknown,
    status_from_sacct,
    status_from_scontrol,
)

SCONTROL_RUNNING_REQUEUED = (
    "JobId=42 JobName=hf-train-abc UserId=mlops(1001) GroupId=mlops(1001) MCS_label=N/A Priority=1 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=2 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:01:05 TimeLimit=01:00:00 TimeMin=N/A "
    "Partition=gpu-training TRES=cpu=4,mem=8G,node=1,billing=4,gres/gpu=1 "
    "Command=(null) WorkDir=/home/mlops StdErr=/data/runs/hf-train-abc-42.err StdIn=/dev/null "
    "StdOut=/data/runs/hf-train-abc-42.out Power="
)
SCONTROL_FAILED = (
    "JobId=43 JobName=hf-x JobState=FAILED Reason=NonZeroExitCode Requeue=0 Restarts=0 ExitCode=3:0 "
    "RunTime=00:00:07 TRES=cpu=1,node=1,billing=1 StdErr=/d/x-43.err StdOut=/d/x-43.out"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (SCONTROL_RUNNING_REQUEUED, dict(job_id="42", state="PENDING", restarts=2, reason="BeginTime",
                                        elapsed_s=65.0, stdout_path="/data/runs/hf-train-abc-42.out",
                                        stderr_path="/data/runs/hf-train-abc-42.err")),
        (SCONTROL_FAILED, dict(job_id="43", state="FAILED", exit_code=3, exit_signal=0, restarts=0, elapsed_s=7.0)),
    ],
    ids=["requeued-pending", "failed"],
)
def test_slurm_status_from_scontrol(text, expected):
    status = status_from_scontrol(text)
    for key, value in expected.items():
        assert getattr(status, key) == value, key
    assert status.source == "scontrol"


def test_slurm_status_from_scontrol_reads_allocated_gpus():
    assert status_from_scontrol(SCONTROL_RUNNING_REQUEUED).alloc_tres["gres/gpu"] == "1"


@pytest.mark.parametrize(
    "stdout, job_id, state, exit_code",
    [
        ("7|hf-a|COMPLETED|0:0|00:01:00|billing=1,cpu=1,gres/gpu=1,node=1|2026-01-01T00:00:00|2026-01-01T00:01:00\n",
         "7", "COMPLETED", 0),
        ("8|hf-b|CANCELLED by 0|0:15|00:00:03|billing=1,cpu=1,node=1|2026-01-01T00:00:00|2026-01-01T00:00:03\n",
         "8", "CANCELLED", 0),
        ("9|hf-c|TIMEOUT|0:0|00:01:30|billing=1,cpu=1,node=1|2026-01-01T00:00:00|2026-01-01T00:01:30\n",
         "9", "TIMEOUT", 0),
    ],
)
def test_slurm_status_from_sacct(stdout, job_id, state, exit_code):
    status = status_from_sacct(stdout, job_id)
    assert (status.state, status.exit_code, status.source) == (state, exit_code, "sacct")


def test_slurm_status_from_sacct_unknown_job_is_none():
    assert status_from_sacct("", "5") is None


@pytest.mark.parametrize(
    "rc, stderr, unknown",
    [(1, "slurm_load_jobs error: Invalid job id specified\n", True), (0, "", False),
     (1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)", False)],
)
def test_slurm_scontrol_unknown_job_falls_back_to_accounting(rc, stderr, unknown):
    assert scontrol_says_unknown(rc, stderr) is unknown


def test_slurm_job_ids_by_name_merges_queue_and_accounting_and_ignores_other_names():
    squeue = "12|hf-x|RUNNING|None|gres:gpu:1|1|0:05\n13|hf-other|PENDING|Resources|N/A|1|0:00\n"
    sacct = ("10|hf-x|FAILED|1:0|00:00:02|billing=1,cpu=1,node=1|2026-01-01T00:00:00|2026-01-01T00:00:02\n"
             "12|allocation|RUNNING|0:0|00:00:05|billing=1,cpu=1,node=1|2026-01-01T00:00:00|Unknown\n")
    assert job_ids_by_name(squeue, sacct, "hf-x") == ["10", "12"]


def status(job_id: str, state: str) -> SlurmJobStatus:
    return SlurmJobStatus(job_id=job_id, name="hf-x", state=state, source="test")


@pytest.mark.parametrize(
    "statuses, requeue, expected",
    [
        ([], True, None),
        ([status("10", "FAILED")], True, None),  # the failed try's job: a retry submits anew
        ([status("10", "FAILED"), status("11", "RUNNING")], True, "11"),
        ([status("10", "COMPLETED")], True, "10"),  # killed at resume: reattach, never resubmit
        ([status("10", "COMPLETED"), status("11", "PENDING")], True, "11"),
        ([status("10", "PREEMPTED")], True, "10"),  # comes back through requeue
        ([status("10", "PREEMPTED")], False, None),
        ([status("9", "CANCELLED"), status("10", "TIMEOUT")], True, None),
    ],
)
def test_slurm_job_to_reattach(statuses, requeue, expected):
    chosen = job_to_reattach(statuses, requeue)
    assert (chosen.job_id if chosen else None) == expected


def test_slurm_status_event_round_trip():
    original = status_from_scontrol(SCONTROL_RUNNING_REQUEUED)
    event = dict(original.to_event(), status="success", message="x")
    assert SlurmJobStatus.from_event(event) == original


@pytest.mark.parametrize(
    "progress, expected",
    [
        ({"step": 120, "total_steps": 400, "loss": 0.41234, "samples_per_s": 2310.4, "eta_s": 112,
          "restarts": 1, "last_checkpoint_step": 100},
         "step 120/400 (30%) loss 0.4123 2,310 samples/s ETA 1m52s restarts 1 ckpt@100"),
        ({"step": 5}, "step 5"),
        ({"eta_s": 7300}, "ETA 2h01m"),
        ({}, "no progress reported yet"),
    ],
)
def test_slurm_progress_line(progress, expected):
    assert describe_progress(progress) == expected
