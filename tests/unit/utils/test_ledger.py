"""The GPU partition ledger (issue 25) from sacct and sacctmgr text: one day of a 2-node, 4-GPU partition."""

from __future__ import annotations

from datetime import datetime

import pytest
from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.ledger import (
    OUTSIDE_SUITE,
    ledger_jobs_argv,
    node_events_argv,
    parse_ledger_jobs,
    parse_node_events,
    partition_day,
)
from hybridflow.utils.slurm_jobs import SlurmJobKey

DAY = (datetime(2026, 12, 6), datetime(2026, 12, 7))
NODES = {"gpu-node-01": 2, "gpu-node-02": 2}
NIGHTLY = SlurmJobKey(dag_id="nightly_training", run_id="scheduled__2026-12-06", task_id="training.train").comment()
RETRAIN = SlurmJobKey(dag_id="retrain", run_id="manual__x", task_id="train", retrain=1).comment()
JOBS = "\n".join([
    f"101|mlops|gpu|COMPLETED|2026-12-06T00:59:00|2026-12-06T01:00:00|2026-12-06T03:00:00|7200|04:00:00|4|cpu=4,gres/gpu=2,node=1|{NIGHTLY}",
    # over midnight
    "102|alice|gpu|COMPLETED|2026-12-05T22:00:00|2026-12-05T23:00:00|2026-12-06T01:00:00|7200|02:00:00|1|cpu=1,gres/gpu=1,node=1|",
    # still running
    f"103|mlops|gpu|RUNNING|2026-12-06T21:00:00|2026-12-06T22:00:00|Unknown|7200|00:00:00|8|cpu=8,gres/gpu=4,node=2|{RETRAIN}",
    "104|bob|gpu|COMPLETED|2026-12-06T10:00:00|2026-12-06T10:00:00|2026-12-06T10:30:00|1800|00:00:00|1|"
    "cpu=1,gres/gpu=1,node=1|by hand | with a bar",
    # no GPU
    "105|mlops|gpu|COMPLETED|2026-12-06T10:00:00|2026-12-06T11:00:00|2026-12-06T12:00:00|3600|01:00:00|2|cpu=2,node=1|",
    f"106|mlops|gpu|NODE_FAIL|2026-12-06T04:58:00|2026-12-06T05:00:00|2026-12-06T05:30:00|1800|00:30:00|2|cpu=2,gres/gpu=2,node=1|{NIGHTLY}",
    f"106|mlops|gpu|COMPLETED|2026-12-06T05:30:00|2026-12-06T06:00:00|2026-12-06T07:00:00|3600|01:30:00|2|cpu=2,gres/gpu=2,node=1|{NIGHTLY}",
    "107|carol|gpu|CANCELLED|2026-12-06T07:00:00|None|2026-12-06T08:00:00|0|00:00:00|0||",
    # a step of 101: its job's line already holds the totals
    "101.batch||gpu|COMPLETED|2026-12-06T01:00:00|2026-12-06T01:00:00|2026-12-06T03:00:00|7200|04:00:00|4|"
    "cpu=4,gres/gpu=2,node=1|",  # never started
])
EVENTS = "\n".join([
    "gpu-node-02|2026-12-06T12:00:00|2026-12-06T14:00:00|DOWN|Not responding",
    "gpu-node-02|2026-12-06T13:00:00|2026-12-06T15:00:00|DRAIN|disk",  # overlaps the one before: counted once
    "gpu-node-01|2026-12-05T22:00:00|2026-12-06T00:30:00|DRAIN|maintenance",  # from the day before
    "|2026-12-06T09:00:00|2026-12-06T09:10:00|CLUSTER|cluster event",  # no node
    "cpu-node-09|2026-12-06T09:00:00|Unknown|DOWN|another partition's node",
])


def test_no_usage_gathered_is_not_measured_rather_than_zero():
    ended = parse_ledger_jobs("1|mlops|gpu|COMPLETED|None|2026-12-06T01:00:00|2026-12-06T02:00:00|3600|00:00:00|2|"
                              "cpu=2,gres/gpu=1,node=1|")
    row = partition_day("gpu", DAY, NODES, ended, [])
    assert row["cpu_efficiency"] is None and "jobacct_gather/none" in row["not_measured"]["cpu_efficiency"]
    assert row["queue_wait_p50_s"] is None  # no submit time recorded


def test_one_day_of_the_partition():
    split = {"shares": {"training_steps": 0.6, "waiting": 0.4}}
    row = partition_day("gpu", DAY, NODES, parse_ledger_jobs(JOBS), parse_node_events(EVENTS), gpu_busy={"101": 0.5},
                        time_splits={"101": split, "999": split})  # 999: another day's job, left out
    assert row["time_split_by_job"] == {"101": {"dag_id": "nightly_training", **split}}
    assert row["gpus"] == 4
    assert row["down_gpu_hours"] == 2 * 3 + 2 * 0.5
    assert row["available_gpu_hours"] == 4 * 24 - 7
    assert row["allocated_gpu_hours"] == 4 + 1 + 8 + 0.5 + 3  # 106's lost first run counts: the GPUs were held
    assert row["utilization"] == round(16.5 / 89, 4) and row["idle_gpu_hours"] == 89 - 16.5
    assert row["by_dag"] == {"retrain": 8.0, "nightly_training": 7.0, OUTSIDE_SUITE: 1.5}
    assert row["by_task"]["nightly_training.training.train"] == 7.0 and row["outside_suite_gpu_hours"] == 1.5
    assert row["by_user"] == {"mlops": 15.0, "alice": 1.0, "bob": 0.5}
    assert row["jobs"] == 6  # runs with GPU time in the day; the CPU job and the one that never started are not
    assert row["busy_gpu_hours"] == 2.0 and row["measured_gpu_hours"] == 4.0
    # waits of the GPU runs that started in the day: 60 s, 0 s, 120 s, 1800 s, 3600 s (102 started the day before)
    assert (row["queue_wait_p50_s"], row["queue_wait_p95_s"]) == (120.0, 3600.0)
    # GPU jobs that ended in the day (101, 102, 104, both runs of 106): CPU time over CPUs x elapsed
    assert row["cpu_efficiency"] == round((4 + 2 + 0 + 0.5 + 1.5) * 3600 / (4 * 7200 + 7200 + 1800 + 2 * 5400), 4)
    assert row["not_measured"]["busy_gpu_hours"].startswith("12.50 of 16.50 allocated GPU-hours had no GPU samples")


def test_an_idle_day_and_a_partition_down_all_day():
    idle = partition_day("gpu", DAY, NODES, [], [])
    assert idle["utilization"] == 0.0 and idle["queue_wait_p50_s"] is None and idle["cpu_efficiency"] is None
    assert set(idle["not_measured"]) == {"cpu_efficiency", "queue_wait"}
    all_day = parse_node_events("\n".join(f"{node}|2026-12-01T00:00:00|Unknown|DOWN|gone" for node in NODES))
    row = partition_day("gpu", DAY, NODES, [], all_day)
    assert row["available_gpu_hours"] == 0 and row["utilization"] is None and row["busy_gpu_hours"] is None


@pytest.mark.parametrize("bad", ["101|mlops|gpu", "101|mlops|gpu|COMPLETED|None|yesterday|x|1|0:00|1|cpu=1|",
                                 "101|mlops|gpu|COMPLETED|None|2026-12-06T01:00:00|None|many|0:00|1|cpu=1|"])
def test_unreadable_accounting_is_an_error(bad):
    with pytest.raises(SlurmOutputParseError):
        parse_ledger_jobs(bad)


def test_the_commands_select_the_partition_and_the_day():
    assert ledger_jobs_argv("gpu", *DAY)[1:8] == ["-a", "-D", "-P", "-n", "-r", "gpu", "-S"]
    assert "Nodes=gpu-node-01,gpu-node-02" in node_events_argv(NODES, *DAY)
