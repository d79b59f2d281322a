"""The stall watch's rule, table by table: when a job counts as stalled and which ranks are blamed; reading the
heartbeats the job writes (jobs/hybridtrain/heartbeat.py) and keeping the frames that matter of a py-spy dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridflow.utils.stalls import (
    RankBeat,
    Stall,
    find_stall,
    parse_heartbeats,
    py_spy_argv,
    read_heartbeats_argv,
    stall_count,
    top_frames,
)
from hybridtrain.heartbeat import Heartbeat

NOW = 10_000.0


def beat(rank, *, progress_ago, written_ago=1.0, step=50, job="77", restart=0, node=None):
    return RankBeat(rank=rank, node=node or f"gpu-node-0{rank + 1}", pid=100 + rank, job_id=job, restart=restart,
                    phase="training", step=step, progress_at=NOW - progress_ago, time=NOW - written_ago)


def stall(beats, *, running_s=600.0, world_size=2, timeout_s=60.0, restarts=0):
    return find_stall(beats, now=NOW, job_id="77", restarts=restarts, running_s=running_s, world_size=world_size,
                      timeout_s=timeout_s)


@pytest.mark.parametrize("beats, running_s, restarts, blamed", [
    # progressing: one rank progressed within the timeout
    ([beat(0, progress_ago=5), beat(1, progress_ago=5)], 600, 0, None),
    ([beat(0, progress_ago=120), beat(1, progress_ago=30)], 600, 0, None),
    # starting up: nobody reported yet, but the attempt is younger than the timeout
    ([], 30, 0, None),
    # nobody reported in the whole attempt: every rank is blamed as never started
    ([], 90, 0, [(0, "no heartbeat"), (1, "no heartbeat")]),
    # a stopped process: its heartbeat thread is silent too; its peer waits alive in a collective
    ([beat(0, progress_ago=70, step=51), beat(1, progress_ago=75, written_ago=75, step=50)], 600, 0,
     [(1, "heartbeat is silent")]),
    # alive but behind: the peers wait on the rank with the lowest step
    ([beat(0, progress_ago=70, step=51), beat(1, progress_ago=70, step=50)], 600, 0, [(1, "behind the others")]),
    # all alive and level: every rank is stuck alike (a shared filesystem)
    ([beat(0, progress_ago=70), beat(1, progress_ago=70)], 600, 0, [(0, "like every rank"), (1, "like every rank")]),
    # one rank never reported while the other stopped progressing
    ([beat(0, progress_ago=70)], 600, 0, [(1, "no heartbeat")]),
    # last attempt's heartbeats (restart 0) do not count for attempt 1: it is judged by its own age
    ([beat(0, progress_ago=5, restart=0), beat(1, progress_ago=5, restart=0)], 30, 1, None),
])
def test_find_stall_blames_the_ranks_that_stopped(beats, running_s, restarts, blamed):
    found = stall(beats, running_s=running_s, restarts=restarts)
    if blamed is None:
        assert found is None
        return
    assert [rank.rank for rank in found.ranks] == [rank for rank, _ in blamed]
    for (_, words), rank in zip(blamed, found.ranks, strict=True):
        assert words in rank.why
    assert found.silent_s >= 60


def test_another_jobs_heartbeats_never_count():
    """A run directory reused by another job (a retry submitted anew) still holds the old job's files."""
    found = stall([beat(0, progress_ago=1, job="76"), beat(1, progress_ago=1, job="76")], running_s=100)
    assert found is not None and [r.why for r in found.ranks] == ["no heartbeat from it in this attempt"] * 2


def test_a_stall_survives_the_trigger_event_and_reads_as_one_line():
    found = stall([beat(0, progress_ago=70, step=51), beat(1, progress_ago=75, written_ago=75)])
    again = Stall.from_event(json.loads(json.dumps(found.to_event())))
    assert again == found
    assert found.summary().startswith("no rank progressed for 70 s (stall_timeout_s=60); stopped: rank 1@gpu-node-02")


def test_heartbeats_written_by_the_job_are_read_back(tmp_path: Path):
    """The job's writer and the trigger's reader agree on the file (the same cat of every rank's file)."""
    (tmp_path / "heartbeats").mkdir()
    for rank in (0, 1):
        heartbeat = Heartbeat(tmp_path, rank=rank, node=f"gpu-node-0{rank + 1}",
                              environ={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}, every_s=60)
        heartbeat.beat(step=40 + rank, phase="training")
        heartbeat.write()
    files = sorted((tmp_path / "heartbeats").glob("rank*.json"))
    stdout = "1700000000.25\n" + "\n".join(path.read_text() for path in files) + "\n{torn"
    now, beats = parse_heartbeats(stdout)
    assert now == 1700000000.25
    assert [(b.rank, b.node, b.job_id, b.restart, b.step, b.phase) for b in beats] == [
        (0, "gpu-node-01", "77", 2, 40, "training"), (1, "gpu-node-02", "77", 2, 41, "training")]


@pytest.mark.parametrize("stdout", ["", "not a clock\n{}", "\n"])
def test_output_without_the_clock_reads_as_nothing(stdout):
    assert parse_heartbeats(stdout) == (None, [])


def test_commands_carry_paths_and_pids_as_arguments_never_as_script_text():
    hostile = "/runs/x'; rm -rf / #"
    argv = read_heartbeats_argv(hostile)
    assert argv[:2] == ["sh", "-c"] and hostile not in argv[2] and argv[-1] == hostile
    found = stall([beat(0, progress_ago=70, step=51), beat(1, progress_ago=75, written_ago=75)])
    spy = py_spy_argv("/venv/bin/py-spy", "77", found.ranks[0])
    assert spy[spy.index("--") + 1:] == ["/venv/bin/py-spy", "dump", "--pid", "101", "--nonblocking",
                                         "--full-filenames"]
    assert "--overlap" in spy and "--jobid=77" in spy and "--nodelist=gpu-node-02" in spy


SITE = "/var/lib/hybridflow/cluster-venv/lib/python3.11/site-packages"
DUMP = """Process 12568: python train.py --config c.json
Python v3.11.2 (/usr/bin/python3.11)

Thread 12568 (idle): "MainThread"
""" + "\n".join(f"    op{i} ({SITE}/torch/distributed/c10d.py:{i})" for i in range(9)) + """
    wait (/usr/lib/python3.11/threading.py:331)
    _Trainer.train (/var/lib/hybridflow/code/jobs/hybridtrain/runner.py:370)
    <module> (/var/lib/hybridflow/code/jobs/train.py:20)

Thread 12570 (idle): "heartbeat"
    wait (/usr/lib/python3.11/threading.py:331)
"""


@pytest.mark.parametrize("frames, expected_lines", [
    (12, ['Thread 12568 (idle): "MainThread"', *[f"    op{i} (torch/distributed/c10d.py:{i})" for i in range(6)],
          "    ... 4 more frame(s) ...", "    _Trainer.train (hybridtrain/runner.py:370)",
          "    <module> (jobs/train.py:20)"]),
    (4, ['Thread 12568 (idle): "MainThread"', "    op0 (torch/distributed/c10d.py:0)",
         "    op1 (torch/distributed/c10d.py:1)", "    ... 8 more frame(s) ...",
         "    _Trainer.train (hybridtrain/runner.py:370)", "    <module> (jobs/train.py:20)"]),
    (20, ['Thread 12568 (idle): "MainThread"', *[f"    op{i} (torch/distributed/c10d.py:{i})" for i in range(9)],
          "    wait (threading.py:331)", "    _Trainer.train (hybridtrain/runner.py:370)",
          "    <module> (jobs/train.py:20)"]),
])
def test_top_frames_keep_where_it_sits_and_the_jobs_own_line(frames, expected_lines):
    assert top_frames(DUMP, frames).splitlines() == expected_lines


def test_top_frames_of_output_that_is_not_a_dump_is_kept_short():
    assert top_frames("Error: Failed to find python version\n" * 500).startswith("Error: Failed")
    assert len(top_frames("x" * 5000)) == 2000


def test_stall_count_counts_only_this_jobs_stalls():
    records = [{"kind": "stall", "job_id": "77"}, {"kind": "requeue", "job_id": "77"}, {"kind": "stall", "job_id": 78},
               {"kind": "stall", "job_id": 77}]
    assert stall_count(records, "77") == 2
