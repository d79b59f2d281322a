"""How a job's end is seen: the batch shell's end marker (a real bash runs the rendered script), the login-node
wait on it (a real sh), and the waits the operator and the trigger take between two looks at the job."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from hybridflow.utils.slurm import SlurmJobSpec, end_marker_path, render_sbatch_script, wait_for_file_argv
from hybridflow.utils.slurm_jobs import EndWatch, SlurmJobStatus, Wait

HANDLES_USR2 = 'trap "echo got-usr2; exit 0" USR2; sleep 30 & wait'
HANDLES_TERM = 'trap "echo got-term; exit 5" TERM; sleep 30 & wait'


def start_script(tmp_path, command: str) -> subprocess.Popen:
    spec = SlurmJobSpec(job_name="end-marker", partition="gpu", command=["bash", "-c", command],
                        end_marker_dir=str(tmp_path), signal="USR2@60")
    script = tmp_path / "batch.sh"
    script.write_text(render_sbatch_script(spec))
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}
    # stdout to a file: the command's own `sleep` child may outlive it and hold a pipe open
    with open(tmp_path / "job.out", "w") as out:
        return subprocess.Popen(["bash", str(script)], env=env, stdout=out)


@pytest.mark.parametrize(("command", "sent", "shell_ends", "marker", "printed"), [
    ("exit 0", None, 0, "0", ""),
    ("echo out; exit 3", None, 3, "3", "out"),
    # killed by a signal: the shell dies of the same one, so accounting keeps 0:<signal> as with exec
    ("kill -9 $$", None, -signal.SIGKILL, "137", ""),
    ("kill -TERM $$", None, -signal.SIGTERM, "143", ""),
    # a signal to the batch shell (B:USR2 before the time limit, scancel --batch) reaches the command
    (HANDLES_USR2, signal.SIGUSR2, 0, "0", "got-usr2"),
    (HANDLES_TERM, signal.SIGTERM, 5, "5", "got-term"),
], ids=["success", "exit-code", "sigkill", "sigterm", "usr2-passed-on", "term-passed-on"])
def test_the_batch_shell_marks_the_end_and_keeps_the_commands_status(tmp_path, command, sent, shell_ends, marker,
                                                                    printed):
    shell = start_script(tmp_path, command)
    if sent is not None:
        time.sleep(0.5)  # the trap is set in the command before it waits
        shell.send_signal(sent)
    assert shell.wait(timeout=20) == shell_ends
    assert (tmp_path / ".ended-41-2").read_text() == f"{marker}\n"
    assert printed in (tmp_path / "job.out").read_text()


def test_without_a_marker_dir_the_command_is_execed():
    script = render_sbatch_script(SlurmJobSpec(job_name="j", partition="p", command=["sleep", "1"]))
    assert script.endswith("exec sleep 1\n") and ".ended-" not in script


def test_a_marker_dir_is_quoted_and_refused_with_a_line_break():
    script = render_sbatch_script(SlurmJobSpec(job_name="j", partition="p", command=["true"],
                                               end_marker_dir="/logs/a b"))
    assert """> '/logs/a b'/.ended-"${SLURM_JOB_ID:-0}"-"${SLURM_RESTART_COUNT:-0}" """ in script
    with pytest.raises(ValueError, match="end_marker_dir"):
        SlurmJobSpec(job_name="j", partition="p", command=["true"], end_marker_dir="/logs\nrm -rf /")


def test_the_login_node_wait_returns_when_the_file_appears_or_after_its_window(tmp_path):
    path = tmp_path / ".ended-1-0"
    started = time.monotonic()
    assert subprocess.run(wait_for_file_argv(str(path), 0.6)).returncode == 1
    assert 0.5 <= time.monotonic() - started < 5
    waiting = subprocess.Popen(wait_for_file_argv(str(path), 30))
    time.sleep(0.3)
    path.write_text("0\n")
    started = time.monotonic()
    assert waiting.wait(timeout=10) == 0 and time.monotonic() - started < 1.0
    assert subprocess.run(wait_for_file_argv("/x/'; touch /tmp/pwned; '", 0.2)).returncode == 1


def status(state: str, restarts: int = 0) -> SlurmJobStatus:
    return SlurmJobStatus(job_id="7", name="j", state=state, source="scontrol", restarts=restarts)


MARKER = "/logs/.ended-7-0"


@pytest.mark.parametrize(("steps", "waits"), [
    # pending: a backoff from min_s to max_s; running: the marker for up to max_s; after it, fast polls
    ([status("PENDING")] * 4 + [status("RUNNING")] * 2 + ["marker", status("RUNNING"), status("COMPLETING")],
     [Wait(1), Wait(2), Wait(4), Wait(8), Wait(10, MARKER), Wait(10, MARKER), Wait(0.2), Wait(0.2)]),
    # a requeue: the new run (restart 1) has its own marker
    ([status("RUNNING"), "marker", status("RUNNING"), status("PENDING", 1), status("RUNNING", 1)],
     [Wait(10, MARKER), Wait(0.2), Wait(1), Wait(10, "/logs/.ended-7-1")]),
    # unknown for a moment (just submitted)
    ([None, None, status("RUNNING")], [Wait(1), Wait(2), Wait(10, MARKER)]),
], ids=["pending-running-ended", "requeued", "unknown-then-running"])
def test_end_watch_waits_on_the_marker_while_the_job_runs(steps, waits):
    watch = EndWatch("/logs", max_s=10, min_s=1)
    got, last = [], None
    for step in steps:
        if step == "marker":
            watch.marker_seen(last)
            continue
        last = step
        got.append(watch.next_wait(step))
    assert got == waits


def test_end_watch_without_a_marker_dir_polls_with_its_backoff():
    watch = EndWatch("", max_s=4, min_s=1)
    assert [watch.next_wait(status("RUNNING")) for _ in range(4)] == [Wait(1), Wait(2), Wait(4), Wait(4)]
    assert end_marker_path("/l", "7", 3) == "/l/.ended-7-3"
