"""Job efficiency from sacct text (issue 25): table-driven over outputs of the shape Slurm 22.05 prints."""

from __future__ import annotations

import pytest
from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.efficiency import (
    NO_GATHERING,
    NO_MEMORY_SAMPLE,
    accounting_settled,
    describe_efficiency,
    describe_time_shares,
    efficiency_argv,
    job_efficiency,
    time_shares,
)

# the local stack's 2-node training job: jobacct_gather/none, so no MaxRSS and TotalCPU 0
UNGATHERED = """\
768|COMPLETED|2026-12-06T01:41:40|2026-12-06T01:41:41|2026-12-06T01:42:01|20|60|00:00:00|4||40000M|billing=4,cpu=4,gres/gpu=2,node=2
768.batch|COMPLETED|2026-12-06T01:41:41|2026-12-06T01:41:41|2026-12-06T01:42:01|20||00:00:00|2|||cpu=2,gres/gpu=1,mem=0,node=1
768.1|COMPLETED|2026-12-06T01:41:41|2026-12-06T01:41:41|2026-12-06T01:42:01|20||00:00:00|4|||cpu=4,gres/gpu=2,mem=0,node=2
"""
# gathered, requeued once after a node failure: the first run's 600 s are lost work
REQUEUED = """\
9|NODE_FAIL|2026-12-06T01:00:00|2026-12-06T01:01:00|2026-12-06T01:11:00|600|120|10:00.000|8|0|16G|cpu=8,gres/gpu=4,node=1
9.batch|CANCELLED|2026-12-06T01:01:00|2026-12-06T01:01:00|2026-12-06T01:11:00|600||00:01.000|8|2048K||cpu=8,gres/gpu=4,node=1
9.0|CANCELLED|2026-12-06T01:01:00|2026-12-06T01:01:00|2026-12-06T01:11:00|600||09:59.000|8|3.5G||cpu=8,gres/gpu=4,node=1
9|COMPLETED|2026-12-06T01:11:30|2026-12-06T01:12:00|2026-12-06T01:42:00|1800|120|02:00:00|8|0|16G|cpu=8,gres/gpu=4,node=1
9.0|COMPLETED|2026-12-06T01:12:00|2026-12-06T01:12:00|2026-12-06T01:42:00|1800||01:59:59|8|6G||cpu=8,gres/gpu=4,node=1
"""
# jobacct_gather/linux, a 3-s job: CPU time recorded, but the step ended before the first MaxRSS sample
SHORT = """\
973|COMPLETED|2026-12-06T04:53:17|2026-12-06T04:53:18|2026-12-06T04:53:21|3|5|00:03.074|1||100M|billing=1,cpu=1,gres/gpu=1,node=1
973.batch|COMPLETED|2026-12-06T04:53:18|2026-12-06T04:53:18|2026-12-06T04:53:21|3||00:03.074|1|||cpu=1,gres/gpu=1,mem=0,node=1
"""


@pytest.mark.parametrize(("text", "job_id", "expected"), [
    (UNGATHERED, "768", {"runs": 1, "requeues": 0, "queue_wait_s": 1.0, "elapsed_s": 20, "time_limit_s": 3600,
                         "time_limit_share": 0.0056, "cpu_efficiency": None, "max_rss_gib": None,
                         "requested_mem_gib": 39.062, "gpus": 2, "gpu_hours_allocated": 0.0111,
                         "lost_to_requeues_s": 0}),
    (REQUEUED, "9", {"runs": 2, "requeues": 1, "queue_wait_s": 60.0, "elapsed_s": 2400, "lost_to_requeues_s": 600,
                     "time_limit_share": 0.25, "cpu_efficiency": round((600 + 7200) / (8 * 2400), 4),
                     "max_rss_gib": 6.0, "requested_mem_gib": 16.0, "gpus": 4,
                     "gpu_hours_allocated": round(4 * 2400 / 3600, 4)}),
    (SHORT, "973", {"runs": 1, "queue_wait_s": 1.0, "time_limit_share": 0.01, "cpu_efficiency": 1.0247,
                    "max_rss_gib": None, "not_measured": {"max_rss_gib": NO_MEMORY_SAMPLE}}),
], ids=["not-gathered", "requeued-gathered", "short-no-memory-sample"])
def test_job_efficiency_from_sacct(text, job_id, expected):
    figures = job_efficiency(text, job_id)
    assert {key: figures[key] for key in expected} == expected


def test_what_slurm_did_not_record_is_not_measured_with_its_reason():
    figures = job_efficiency(UNGATHERED, "768")
    assert figures["not_measured"] == {"cpu_efficiency": NO_GATHERING, "max_rss_gib": NO_GATHERING}
    line = describe_efficiency(figures)
    assert line.startswith("queued 1 s, ran 20 s (1% of its limit), 0.0111 GPU-hours")
    assert "cpu_efficiency not measured: the cluster records no per-step usage" in line


def test_a_job_that_never_started_has_no_figures():
    never = "5|CANCELLED|2026-12-06T01:00:00|None|2026-12-06T01:00:09|0|60|00:00:00|0||4G|\n"
    assert job_efficiency(never, "5") == {"job_id": "5", "runs": 0, "not_measured": {"all": "the job never started"}}
    assert describe_efficiency(job_efficiency(never, "5")) == "the job never started"


@pytest.mark.parametrize("bad", [
    "9|COMPLETED|only three",
    "9|COMPLETED|2026-12-06T01:00:00|2026-12-06T01:01:00|x|sixty|120|00:01:00|8||16G|cpu=8",
    "9|COMPLETED|2026-12-06T01:00:00|2026-12-06T01:01:00|x|60|120|00:01:00|8||16 gigs|cpu=8",
], ids=["fields", "elapsed", "size"])
def test_unreadable_sacct_output_is_an_error_quoting_it(bad):
    with pytest.raises(SlurmOutputParseError):
        job_efficiency(bad, "9")


def test_the_sacct_command_lists_every_run_and_its_steps():
    argv = efficiency_argv("42")
    assert argv[:6] == ["sacct", "-j", "42", "-D", "-P", "-n"] and argv[-1].startswith("--format=JobID,State,")


@pytest.mark.parametrize(("text", "settled"), [
    (SHORT, True),
    (REQUEUED, True),
    ("", False),  # accounting has not heard of it yet
    ("973|RUNNING|2026-12-06T04:53:17|2026-12-06T04:53:18|Unknown|3|5|00:00:00|1||100M|cpu=1,node=1\n", False),
    ("973|COMPLETING|2026-12-06T04:53:17|2026-12-06T04:53:18|2026-12-06T04:53:21|3|5|00:00:00|1||100M|cpu=1\n",
     False),
    ("9|NODE_FAIL|2026-12-06T01:00:00|2026-12-06T01:01:00|2026-12-06T01:11:00|600|120|10:00.000|8|0|16G|cpu=8\n"
     "9|REQUEUED|2026-12-06T01:11:30|Unknown|Unknown|0|120|00:00:00|8|0|16G|cpu=8\n", False),  # it runs again
])
def test_accounting_is_settled_once_the_last_run_has_its_end(text, settled):
    job_id = text.split("|", 1)[0] or "973"
    assert accounting_settled(text, job_id) is settled


@pytest.mark.parametrize(("split", "allocated", "expected"), [
    ({"startup": 4.0, "data_loading": 2.0, "rendezvous": 1.0, "training_steps": 20.0, "checkpoint_writes": 3.0,
      "evaluation": 2.0, "export": 1.0}, 40.0,
     {"training_steps": 0.5, "data_loading": 0.05, "rendezvous": 0.025, "checkpoint_writes": 0.075,
      "evaluation": 0.05, "startup": 0.1, "export": 0.025, "waiting": 0.175}),
    ({"training_steps": 50.0, "a_new_phase": 2.0}, 40.0, {"training_steps": 1.25, "a_new_phase": 0.05,
                                                           "waiting": 0.0}),  # clocks disagree: no negative wait
    ({"training_steps": "x", "rendezvous": -1, "evaluation": True}, 10.0, {"waiting": 1.0}),  # not figures
])
def test_a_jobs_time_split_as_shares_of_its_allocated_time(split, allocated, expected):
    result = time_shares(split, allocated)
    assert result["shares"] == expected and list(result["shares"]) == list(expected)


@pytest.mark.parametrize(("split", "allocated"), [(None, 10.0), ({}, 10.0), ({"training_steps": 1.0}, None),
                                                  ({"training_steps": 1.0}, 0)])
def test_no_split_without_the_jobs_figures(split, allocated):
    assert time_shares(split, allocated) is None and describe_time_shares(None) is None


def test_the_split_in_one_line():
    line = describe_time_shares(time_shares({"training_steps": 30.0, "data_loading": 6.0, "export": 0.1}, 40.0))
    assert line == "training steps 75%, data loading 15%, waiting 10%"
