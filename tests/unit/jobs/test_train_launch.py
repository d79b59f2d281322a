"""Where the training process sits in the job (torch.distributed from launchers or Slurm), and preemption."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "jobs"))

from hybridtrain.errors import ExitCode, RequeueError  # noqa: E402
from hybridtrain.launch import distributed_environment, first_node, free_port, restart_count  # noqa: E402
from hybridtrain.preemption import StopRequest, requeue_command, requeue_job  # noqa: E402


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu-node-01", "gpu-node-01"),
        ("gpu-node-[01-04]", "gpu-node-01"),
        ("gpu-node-[07,01-04]", "gpu-node-07"),
        ("gpu-[1-2],cpu-[3-4]", "gpu-1"),
        ("a1,a2", "a1"),
        ("rack[2-3]-node[05-06]", "rack2-node05"),
    ],
)
def test_training_first_node_of_slurm_nodelist(nodelist, first):
    assert first_node(nodelist) == first


SINGLE = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "45678",
}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, SINGLE),
        (
            {
                "SLURM_JOB_ID": "123",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_JOB_NODELIST": "gpu-[01-02]",
            },
            SINGLE,
        ),
        (
            {
                "SLURM_JOB_ID": "123",
                "SLURM_PROCID": "5",
                "SLURM_LOCALID": "1",
                "SLURM_STEP_NUM_TASKS": "8",
                "SLURM_STEP_NODELIST": "gpu-[03-06]",
                "SLURM_JOB_NODELIST": "gpu-[01-06]",
            },
            {
                "RANK": "5",
                "WORLD_SIZE": "8",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "gpu-03",
                "MASTER_PORT": "20123",
            },
        ),
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500",
                "SLURM_PROCID": "0",
                "SLURM_STEP_NUM_TASKS": "1",
            },
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500",
            },
        ),
        (
            {"SLURM_JOB_ID": "99", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"},
            SINGLE,
        ),
    ],
    ids=["no-launcher", "batch-script-of-multi-task-job", "srun-step", "torchrun-wins", "srun-one-task"],
)
def test_training_distributed_environment(environ, expected):
    assert distributed_environment(environ, lambda: 45678) == expected


def test_training_distributed_environment_needs_a_port_for_several_processes():
    with pytest.raises(ValueError, match="MASTER_PORT"):
        distributed_environment({"WORLD_SIZE": "2", "RANK": "0"}, lambda: 1)


def test_training_free_port_is_bindable():
    assert 0 < free_port() < 65536


@pytest.mark.parametrize(
    ("environ", "previous", "expected"),
    [
        ({}, None, 0),
        ({}, 2, 3),
        ({"SLURM_RESTART_COUNT": "4"}, 0, 4),
        ({"SLURM_RESTART_COUNT": "0"}, None, 0),
    ],
)
def test_training_restart_count(environ, previous, expected):
    assert restart_count(environ, previous) == expected


@pytest.fixture
def restore_signal_handlers():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_training_stop_request_records_signals_and_usr2_wins(restore_signal_handlers):
    stop = StopRequest()
    stop.install()
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGTERM)
    assert (stop.requested, StopRequest.signal_for(stop.code)) == (True, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)
    assert StopRequest.signal_for(stop.code) == signal.SIGUSR2


def fake_scontrol(tmp_path: Path, script: str) -> dict[str, str]:
    """A stand-in scontrol on PATH: this machine's Slurm is not this test's subject."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "scontrol"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_training_requeue_runs_scontrol(tmp_path, monkeypatch):
    record = tmp_path / "args"
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, f'echo "$@" > {record}\n')["PATH"])
    requeue_job("4242")
    assert record.read_text().strip() == "requeue 4242"
    assert requeue_command("4242") == ["scontrol", "requeue", "4242"]


def test_training_requeue_failure_quotes_scontrol(tmp_path, monkeypatch):
    script = 'echo "scontrol: error: Requeue of JobId=4242 not allowed" >&2\nexit 1\n'
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, script)["PATH"])
    with pytest.raises(RequeueError) as raised:
        requeue_job("4242")
    assert "`scontrol requeue 4242` exited 1: scontrol: error: Requeue of JobId=4242 not allowed" in str(
        raised.value
    )
    assert raised.value.exit_code == ExitCode.REQUEUE_FAILED


def test_training_requeue_without_scontrol(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RequeueError, match="could not run"):
        requeue_job("1")


def test_training_exit_codes_are_stable():
    assert {code.name: int(code) for code in ExitCode} == {
        "OK": 0,
        "FAILED": 1,
        "INVALID_INPUT": 2,
        "STOPPED": 75,
        "REQUEUE_FAILED": 76,
        "TERMINATED": 143,
    }
