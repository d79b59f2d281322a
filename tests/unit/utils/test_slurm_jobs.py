"""Tracking one Slurm job: statuses from scontrol/sacct answers, the reattach rule and the job key, by tables."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hybridflow.utils.progress import describe_progress
from hybridflow.utils.slurm import JOB_COMMENT_MAX_BYTES, deterministic_job_name, render_sbatch_script
from hybridflow.utils.slurm_jobs import (
    SlurmJobKey,
    SlurmJobStatus,
    job_ids_by_name,
    job_to_reattach,
    scontrol_says_unknown,
    status_from_sacct,
    status_from_scontrol,
)

# Job keys carry the Airflow deployment from the environment: a session beside the stack has the stack's.
pytestmark = pytest.mark.usefixtures("default_deployment")

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
         "step 120/400 (30%) loss 0.4123 2,310 rows/s ETA 1m52s restarts 1 ckpt@100"),
        ({"step": 5}, "step 5"),
        ({"eta_s": 7300}, "ETA 2h01m"),
        ({}, "no progress reported yet"),
    ],
)
def test_slurm_progress_line(progress, expected):
    assert describe_progress(progress) == expected


# --- the job key: which task instance a job runs for ------------------------------------------------------------

RUN_ID = "manual__2026-12-01T02:30:00+00:00"


@pytest.mark.parametrize(
    "key, task_key",
    [
        (SlurmJobKey("nightly_training", RUN_ID, "training.train"), "training.train"),
        (SlurmJobKey("workload_router", RUN_ID, "run_on_gpu_slurm", map_index=0), "run_on_gpu_slurm.0"),
        (SlurmJobKey("nightly_training", RUN_ID, "training.train", retrain=3), "training.train@retrain-3"),
        (SlurmJobKey("d", RUN_ID, "t", map_index=7, retrain=1), "t.7@retrain-1"),
    ],
    ids=["plain", "mapped", "retrain", "mapped-retrain"],
)
def test_job_key_makes_the_names_the_operators_always_gave(key, task_key):
    assert key.job_name == deterministic_job_name(key.dag_id, task_key, key.run_id)
    assert SlurmJobKey.from_comment(key.comment()) == key


def test_job_key_comment_is_compact_json_naming_the_task_instance():
    key = SlurmJobKey("nightly_training", RUN_ID, "training.train")
    assert key.comment() == ('{"dag_id":"nightly_training","run_id":"manual__2026-12-01T02:30:00+00:00",'
                             '"task_id":"training.train","map_index":-1,"retrain":0,"deployment":"default","v":1}')


@pytest.mark.parametrize(
    "key",
    [SlurmJobKey("d", 'run"quoted', "t"), SlurmJobKey("d", "run\\back", "t"), SlurmJobKey("d", "r\nline", "t"),
     SlurmJobKey("d" * 250, "r" * 250, "t" * (JOB_COMMENT_MAX_BYTES - 500))],
    ids=["double-quote", "backslash", "newline", "too-long"],
)
def test_job_key_without_a_comment_sbatch_could_carry_intact(key):
    """An #SBATCH line drops backslashes (JSON escapes need them) and slurmctld refuses over 1024 bytes: no key,
    and the reconciler never touches such a job."""
    assert key.comment() is None


def test_job_key_of_the_longest_airflow_ids_fits():
    assert SlurmJobKey("d" * 250, "r" * 250, "t" * 250, map_index=99_999, retrain=1000,
                       deployment="x" * 64).comment() is not None


GOOD_KEY = {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1, "retrain": 0, "deployment": "local-1",
            "v": 1}


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", "null", json.dumps({**GOOD_KEY, "v": 2}), json.dumps({**GOOD_KEY, "extra": 1}),
     json.dumps({k: v for k, v in GOOD_KEY.items() if k != "retrain"}), json.dumps({**GOOD_KEY, "dag_id": ""}),
     json.dumps({**GOOD_KEY, "map_index": -2}), json.dumps({**GOOD_KEY, "map_index": "0"}),
     json.dumps({**GOOD_KEY, "map_index": True}), json.dumps({**GOOD_KEY, "retrain": 1001}),
     json.dumps({**GOOD_KEY, "retrain": 1.0}), json.dumps({**GOOD_KEY, "task_id": None}),
     json.dumps({k: v for k, v in GOOD_KEY.items() if k != "deployment"}), json.dumps({**GOOD_KEY, "deployment": 1})],
)
def test_job_key_from_any_other_comment_is_none(text):
    assert SlurmJobKey.from_comment(text) is None


def test_job_key_from_comment():
    assert SlurmJobKey.from_comment(json.dumps(GOOD_KEY)) == SlurmJobKey("d", "r", "t", deployment="local-1")


def context_for(dag_id="nightly_training", task_id="training.train", map_index=-1):
    return {"ti": SimpleNamespace(dag_id=dag_id, task_id=task_id, map_index=map_index, run_id=RUN_ID), "params": {}}


@pytest.mark.parametrize("map_index", [-1, 4])
def test_job_key_is_in_the_script_the_operator_submits(map_index):
    from hybridflow.operators.slurm import SlurmSubmitOperator

    op = SlurmSubmitOperator(task_id="run_on_gpu_slurm", command=["true"], partition="cpu", log_dir="/l")
    key = op.job_key(context_for("workload_router", "run_on_gpu_slurm", map_index))
    assert key == SlurmJobKey("workload_router", RUN_ID, "run_on_gpu_slurm", map_index=map_index)
    script = render_sbatch_script(op.build_spec(key.job_name, key.comment()))
    assert f"#SBATCH --job-name={key.job_name}\n" in script
    assert f"#SBATCH --comment='{key.comment()}'\n" in script


def test_job_key_of_a_training_generation_names_its_generation():
    from hybridflow.operators.training import DeepSpeedTrainingOperator

    op = DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir="/runs/r", python="/py", jobs_dir="/j",
                                   partition="gpu-training", retrain="{{ params.retrain }}")
    op.render_template_fields({**context_for(task_id="training.train"), "params": {"retrain": 2}})
    key = op.job_key(context_for(task_id="training.train"))
    assert key == SlurmJobKey("nightly_training", RUN_ID, "training.train", retrain=2)
    assert op.job_name(context_for(task_id="training.train")) == key.job_name
