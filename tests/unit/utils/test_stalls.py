"""The stall watch's rule, table by table: when a job counts as stalled and which ranks are blamed; reading the
heartbeats the job writes (jobs/hybridtrain/heartbeat.py) and keeping the frames that matter of a py-spy dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridflow.exceptions import InvalidJobSpecError
from hybridflow.utils.stalls import (
    RankBeat,
    Stall,
    StallWatch,
    find_stall,
    parse_heartbeats,
    py_spy_argv,
    read_heartbeats_argv,
    stall_count,
    top_frames,
)
from hybridtrain.heartbeat import Heartbeat

NOW = 10_000.0
WATCH = StallWatch(timeout_s=60.0, floor_s=30.0, factor=10.0, warm_up_steps=5)
STEADY = {"step_s": (0.05,) * 32, "steps_timed": 40}  # past warm-up, 0.05 s steps: the floor decides (30 s)
SLOW = {"step_s": (5.0,) * 32, "steps_timed": 40}  # 5 s steps: 10 x 5 s = 50 s
GLACIAL = {"step_s": (10.0,) * 32, "steps_timed": 40}  # 10 x 10 s = 100 s, capped at stall_timeout_s


def beat(rank, *, progress_ago, written_ago=1.0, step=50, job="77", restart=0, node=None, phase="training",
         timed=None, every_s=5.0):
    return RankBeat(rank=rank, node=node or f"gpu-node-0{rank + 1}", pid=100 + rank, job_id=job, restart=restart,
                    phase=phase, step=step, progress_at=NOW - progress_ago, time=NOW - written_ago, **(timed or {}),
                    every_s=every_s)


def stopped(rank, *, ago, step=50, phase="training", timed=None, every_s=5.0):
    """A rank whose process stopped ``ago`` seconds ago: its progress and its heartbeat thread alike."""
    return beat(rank, progress_ago=ago, written_ago=ago, step=step, phase=phase, timed=timed, every_s=every_s)


def stall(beats, *, running_s=600.0, world_size=2, restarts=0, watch=WATCH):
    return find_stall(beats, now=NOW, job_id="77", restarts=restarts, running_s=running_s, world_size=world_size,
                      watch=watch)


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
    assert all(rank.late_s >= rank.deadline_s for rank in found.ranks)


@pytest.mark.parametrize("case, beats, blamed", [
    # SIGSTOP of rank 1 mid-training: its peer waits in the step's collective; both past the 30 s floor
    ("stopped in training, 25 s", [beat(0, progress_ago=25, timed=STEADY), stopped(1, ago=26, timed=STEADY)], None),
    ("stopped in training, 35 s", [beat(0, progress_ago=34, timed=STEADY), stopped(1, ago=35, timed=STEADY)],
     [(1, 30, "heartbeat is silent")]),
    # rank 1 stopped right after its step; rank 0 went on into a checkpoint and waits there (its long deadline)
    ("stopped while the peer checkpoints", [beat(0, progress_ago=20, phase="checkpointing", timed=STEADY),
                                            stopped(1, ago=35, timed=STEADY)], [(1, 30, "heartbeat is silent")]),
    # alive and behind, past warm-up: blamed once every rank is past its deadline
    ("hung alive in training", [beat(0, progress_ago=34, step=51, timed=STEADY),
                                beat(1, progress_ago=35, step=50, timed=STEADY)], [(1, 30, "behind the others")]),
    # a rank whose steps are long is not late at 40 s (10 x 5 s = 50 s), is at 55 s
    ("long steps, 40 s", [beat(0, progress_ago=40, timed=SLOW), beat(1, progress_ago=40, timed=SLOW)], None),
    ("long steps, 55 s", [beat(0, progress_ago=55, step=51, timed=SLOW), stopped(1, ago=55, timed=SLOW)],
     [(1, 50, "heartbeat is silent")]),
    # never above stall_timeout_s, however long the steps
    ("glacial steps, 65 s", [beat(0, progress_ago=65, timed=GLACIAL), stopped(1, ago=65, timed=GLACIAL)],
     [(1, 60, "heartbeat is silent")]),
    # rank 0 hashes a checkpoint for its manifest while rank 1, back in training, waits on it: no false alarm
    ("rank 0 checkpoints alone", [beat(0, progress_ago=45, phase="checkpointing", timed=STEADY),
                                  beat(1, progress_ago=45, timed=STEADY)], None),
    ("every rank checkpoints", [beat(0, progress_ago=45, phase="checkpointing", timed=STEADY),
                                beat(1, progress_ago=45, phase="checkpointing", timed=STEADY)], None),
    # a rank stopped in a checkpoint write: its progress deadline is stall_timeout_s, but its silent thread says
    # the process stopped once max(stall_floor_s, 3 x heartbeat_every_s) passed
    ("stopped in a checkpoint, 25 s", [beat(0, progress_ago=25, phase="checkpointing", timed=STEADY),
                                       stopped(1, ago=25, phase="checkpointing", timed=STEADY)], None),
    ("stopped in a checkpoint, 35 s", [beat(0, progress_ago=35, phase="checkpointing", timed=STEADY),
                                       stopped(1, ago=35, phase="checkpointing", timed=STEADY)],
     [(1, 60, "heartbeat is silent too (last 35 s ago, over 30 s = max(stall_floor_s=30, 3 x heartbeat_every_s=5)")]),
    ("slow heartbeat, 45 s", [beat(0, progress_ago=45, phase="checkpointing", timed=STEADY, every_s=20),
                              stopped(1, ago=45, phase="checkpointing", timed=STEADY, every_s=20)], None),
    ("slow heartbeat, 65 s", [beat(0, progress_ago=65, phase="checkpointing", timed=STEADY, every_s=20),
                              stopped(1, ago=65, phase="checkpointing", timed=STEADY, every_s=20)],
     [(1, 60, "over 60 s = max(stall_floor_s=30, 3 x heartbeat_every_s=20)")]),
    # warming up (3 of 5 steps timed): alive ranks have stall_timeout_s, not the floor; a stopped one is silent
    ("warming up", [beat(0, progress_ago=45, step=51, timed={"step_s": (0.05,) * 3, "steps_timed": 3}),
                    beat(1, progress_ago=45, timed={"step_s": (0.05,) * 3, "steps_timed": 3})], None),
    ("stopped warming up", [beat(0, progress_ago=35, step=51, timed={"step_s": (0.05,) * 3, "steps_timed": 3}),
                            stopped(1, ago=35, timed={"step_s": (0.05,) * 3, "steps_timed": 3})],
     [(1, 60, "heartbeat is silent")]),
    # a rank that exited stops writing: rank 0 still exports the model
    ("a rank exited", [beat(0, progress_ago=5, phase="finishing", timed=STEADY),
                       stopped(1, ago=100, phase="exited", timed=STEADY)], None),
])
def test_each_rank_has_a_deadline_of_its_own(case, beats, blamed):
    found = stall(beats)
    if blamed is None:
        assert found is None, found.summary()
        return
    assert [(r.rank, r.deadline_s) for r in found.ranks] == [(rank, deadline) for rank, deadline, _ in blamed], case
    for (_, _, words), rank in zip(blamed, found.ranks, strict=True):
        assert words in rank.why


@pytest.mark.parametrize("timed, seconds, basis", [
    (STEADY, 30, "max(stall_floor_s=30, stall_factor=10 x median step 0.05 s over 32 steps), at most "
                 "stall_timeout_s=60"),
    (SLOW, 50, "x median step 5 s over 32 steps"),
    # the attempt's first warm_up_steps steps are left out of the median (they compile, set up collectives)
    ({"step_s": (20.0,) * 5 + (0.05, 0.05), "steps_timed": 7}, 30, "median step 0.05 s over 2 steps"),
    ({"step_s": (20.0,) * 5, "steps_timed": 5}, 60, "stall_timeout_s=60 (warming up: 5 of stall_warm_up_steps=5"),
    ({}, 60, "stall_timeout_s=60 (warming up: 0 of"),
])
def test_a_deadline_states_its_median_and_sample_size(timed, seconds, basis):
    deadline = WATCH.deadline(beat(0, progress_ago=0, timed=timed))
    assert deadline.seconds == seconds and basis in deadline.basis


def test_a_phase_other_than_training_has_the_long_deadline():
    deadline = WATCH.deadline(beat(0, progress_ago=0, phase="loading data", timed=STEADY))
    assert (deadline.seconds, deadline.basis) == (60, "stall_timeout_s=60 (phase loading data)")


def test_another_jobs_heartbeats_never_count():
    """A run directory reused by another job (a retry submitted anew) still holds the old job's files."""
    found = stall([beat(0, progress_ago=1, job="76"), beat(1, progress_ago=1, job="76")], running_s=100)
    assert found is not None and [r.why for r in found.ranks] == ["no heartbeat from it in this attempt"] * 2


def test_a_stall_survives_the_trigger_event_and_reads_as_one_line():
    found = stall([beat(0, progress_ago=34, step=51, timed=STEADY), stopped(1, ago=36, timed=STEADY)])
    again = Stall.from_event(json.loads(json.dumps(found.to_event())))
    assert again == found
    assert found.summary() == (
        "no rank progressed for 34 s; stopped: rank 1@gpu-node-02 (pid 101, step 50 at its last heartbeat, "
        "training; no progress for 36 s, deadline 30 s = max(stall_floor_s=30, stall_factor=10 x median step 0.05 s "
        "over 32 steps), at most stall_timeout_s=60; its heartbeat is silent too (last 36 s ago, over 30 s = "
        "max(stall_floor_s=30, 3 x heartbeat_every_s=5)): the process stopped)")


@pytest.mark.parametrize("settings, expected", [
    ({}, StallWatch(900.0, 30.0, 10.0, 5)),
    # a rendered template's text, as the nightly DAG passes its params
    ({"stall_timeout_s": "600.0", "stall_floor_s": "45", "stall_factor": "20.5", "stall_warm_up_steps": "8"},
     StallWatch(600.0, 45.0, 20.5, 8)),
    ({"stall_warm_up_steps": 3.0}, StallWatch(900.0, 30.0, 10.0, 3)),
    ({"stall_timeout_s": 0}, None),
    ({"stall_timeout_s": "0"}, None),
])
def test_the_watch_from_an_operators_fields(settings, expected):
    defaults = {"stall_timeout_s": 900.0, "stall_floor_s": 30.0, "stall_factor": 10.0, "stall_warm_up_steps": 5}
    assert StallWatch.from_settings(defaults | settings) == expected


BAD_SETTINGS = [(name, value) for name in ("stall_timeout_s", "stall_floor_s", "stall_factor", "stall_warm_up_steps")
                for value in (None, True, "", "abc", "nan", "inf", "-inf", "1e400", float("nan"), float("inf"), -1,
                              1e9, [30])]
BAD_SETTINGS += [("stall_timeout_s", 9.9), ("stall_floor_s", 9), ("stall_factor", 1.5), ("stall_warm_up_steps", 0),
                 ("stall_warm_up_steps", 2.5), ("stall_warm_up_steps", "2.5"), ("stall_timeout_s", 86_401)]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_a_setting_out_of_its_bounds_is_refused_naming_it(name, value):
    settings = {"stall_timeout_s": 900.0, "stall_floor_s": 30.0, "stall_factor": 10.0, "stall_warm_up_steps": 5}
    with pytest.raises(InvalidJobSpecError, match=f"^{name}=.* is invalid: use a"):
        StallWatch.from_settings(settings | {name: value})


def test_the_collective_timeout_is_above_the_longest_deadline_and_the_checks_come_often():
    """Past stall_timeout_s and the watch's own heal (a check, the stacks, the requeue), so a hung rank is named
    before gloo or NCCL fail the job; the heartbeats are read four times within the shortest deadline."""
    assert WATCH.collective_timeout_s == 60 + 180
    assert WATCH.check_every_s == 7.5
    assert StallWatch(900.0, 300.0, 10.0, 5).check_every_s == 30.0


def test_heartbeats_written_by_the_job_are_read_back(tmp_path: Path):
    """The job's writer and the trigger's reader agree on the file (the same cat of every rank's file), its phase
    name and its step times included: eight steps of 0.25 s make a deadline from the median past warm-up."""
    (tmp_path / "heartbeats").mkdir()
    for rank in (0, 1):
        ticks = iter(range(100))
        heartbeat = Heartbeat(tmp_path, rank=rank, node=f"gpu-node-0{rank + 1}",
                              environ={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}, every_s=60,
                              clock=lambda ticks=ticks: 1_700_000_000 + next(ticks) / 4)
        heartbeat.beat(step=32 + rank, phase="training")
        for step in range(33 + rank, 41 + rank):
            heartbeat.beat(step=step)
        heartbeat.write()
    files = sorted((tmp_path / "heartbeats").glob("rank*.json"))
    stdout = "1700000000.25\n" + "\n".join(path.read_text() for path in files) + "\n{torn"
    now, beats = parse_heartbeats(stdout)
    assert now == 1700000000.25
    assert [(b.rank, b.node, b.job_id, b.restart, b.step, b.phase, b.steps_timed, b.every_s) for b in beats] == [
        (0, "gpu-node-01", "77", 2, 40, "training", 8, 60), (1, "gpu-node-02", "77", 2, 41, "training", 8, 60)]
    deadline = WATCH.deadline(beats[0])
    assert "median step 0.25 s over 3 steps" in deadline.basis and deadline.seconds == 30


@pytest.mark.parametrize("stdout", ["", "not a clock\n{}", "\n"])
def test_output_without_the_clock_reads_as_nothing(stdout):
    assert parse_heartbeats(stdout) == (None, [])


def test_commands_carry_paths_and_pids_as_arguments_never_as_script_text():
    hostile = "/runs/x'; rm -rf / #"
    argv = read_heartbeats_argv(hostile)
    assert argv[:2] == ["sh", "-c"] and hostile not in argv[2] and argv[-1] == hostile
    found = stall([beat(0, progress_ago=70, step=51), stopped(1, ago=75)])
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
