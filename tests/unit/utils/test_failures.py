"""The failure-class table as checked in (include/config/pipeline.yaml ``recovery.failure_classes``): what each
kind of job end is called and what the operator does about it; the recovery log's lines."""

from __future__ import annotations

import pytest
from hybridflow.config import FailureClass, load_pipeline_config
from hybridflow.utils.failures import (
    classify,
    excluded_nodes,
    parse_recovery_log,
    recovery_line,
    recovery_log_path,
    unhealthy_node,
)

CLASSES = load_pipeline_config().recovery.failure_classes
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
NCCL = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"
PEER = "rank0@gpu-node-01 ERROR hybridtrain: a collective operation failed (collective_timeout_s=300): another rank"


@pytest.mark.parametrize("state, exit_code, signal, log_text, name, action", [
    # jobs/ exit 2 is bad data or config: retrying the same input cannot help, whatever the log says
    ("FAILED", 2, 0, "FeatureDataError: ds=2026-01-02 is not published", "data_or_config_error", "fail"),
    ("FAILED", 2, 0, NCCL, "data_or_config_error", "fail"),
    ("FAILED", 79, 0, "NODE CHECK FAILED on gpu-node-01: free space", "unhealthy_node", "exclude_node"),
    ("FAILED", 1, 0, OOM, "cuda_out_of_memory", "fail"),
    ("FAILED", 1, 0, NCCL, "nccl_or_peer_lost", "requeue"),
    ("FAILED", 1, 0, PEER, "nccl_or_peer_lost", "requeue"),
    ("NODE_FAIL", 0, 0, "", "node_failure", "requeue"),
    ("PREEMPTED", 0, 0, "", "preempted", "requeue"),
    ("TIMEOUT", 0, 15, "", "time_limit", "retry"),
    ("CANCELLED", 0, 15, "", "cancelled", "fail"),
    ("OUT_OF_MEMORY", 0, 9, "", "unclassified", "retry"),
    ("FAILED", 1, 0, "Traceback ... ZeroDivisionError", "unclassified", "retry"),
    ("FAILED", None, None, "", "unclassified", "retry"),
])
def test_the_checked_in_table_names_each_end_and_its_action(state, exit_code, signal, log_text, name, action):
    verdict = classify(CLASSES, state=state, exit_code=exit_code, signal=signal, log_text=log_text)
    assert (verdict.name, verdict.action) == (name, action)
    assert verdict.runbook.startswith("training.md#") and verdict.name in verdict.describe()


def test_every_criterion_of_a_row_must_match_and_the_first_row_wins():
    rows = {
        "oom_on_exit_1": FailureClass(action="fail", runbook="training.md#x", exit_codes=(1,), log_pattern="OOM"),
        "any_exit_1": FailureClass(action="requeue", runbook="training.md#y", exit_codes=(1,)),
        "killed": FailureClass(action="retry", runbook="training.md#z", states=("FAILED",), signals=(9,)),
    }
    judge = lambda **end: classify(rows, **{"state": "FAILED", "signal": 0, "log_text": ""} | end).name  # noqa: E731
    assert judge(exit_code=1, log_text="... OOM ...") == "oom_on_exit_1"
    assert judge(exit_code=1) == "any_exit_1"
    assert judge(exit_code=0, signal=9) == "killed"
    assert judge(exit_code=0, signal=9, state="TIMEOUT") == "unclassified"


def test_recovery_log_round_trips_and_skips_torn_lines():
    records = [{"kind": "stall", "job_id": "7"}, {"kind": "exclude_node", "node": "gpu-node-01"},
               {"kind": "exclude_node", "node": "gpu-node-01"}, {"kind": "exclude_node", "node": "gpu-node-02"}]
    text = "".join(map(recovery_line, records)) + '{"kind": "sta' + "\n[1]\n"
    assert parse_recovery_log(text) == records
    assert parse_recovery_log(None) == []
    assert excluded_nodes(records) == ["gpu-node-01", "gpu-node-02"]
    assert recovery_log_path("/runs/r/logs/", "hf-x") == "/runs/r/logs/hf-x.recovery.jsonl"


@pytest.mark.parametrize("log_text, exit_code, found", [
    ("x\nNODE CHECK FAILED on gpu-node-01: scratch: /s/gpu-node-01: Permission denied\nsrun: error: gpu-node-01: "
     "task 0: Exited with exit code 79\n", 79, ("gpu-node-01", "scratch", "/s/gpu-node-01: Permission denied")),
    ("srun: error: gpu-node-02: task 1: Exited with exit code 79\n", 79,
     ("gpu-node-02", "unknown", "its self-check exited 79")),
    ("srun: error: gpu-node-02: task 1: Exited with exit code 1\n", 79, None),
    ("Traceback ...", 79, None),
])
def test_the_unhealthy_node_is_read_from_the_check_line_else_from_srun(log_text, exit_code, found):
    assert unhealthy_node(log_text, exit_code) == found
