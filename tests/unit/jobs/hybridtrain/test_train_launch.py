"""Where the training process sits in the job (torch.distributed from launchers or Slurm), and preemption."""

from __future__ import annotations

import logging
import os
import signal
import stat
from pathlib import Path

import pytest
from hybridtrain.errors import ExitCode, RequeueError, ResumeError, collective_failure
from hybridtrain.launch import (
    cuda_device_index,
    describe_ranks,
    distributed_environment,
    first_node,
    free_port,
    log_format,
    node_name,
    restart_count,
)
from hybridtrain.preemption import StopRequest, requeue_command, requeue_job


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


@pytest.mark.parametrize(
    ("local_rank", "device_count", "index"),
    [
        (0, 1, 0),
        (1, 1, 0),
        (3, 1, 0),
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 3),
        (1, 2, 1),
        (2, 2, 0),
        (1, 0, 0),
    ],
    ids=[
        "one-gpu-rank0",
        "slurm-binds-one-gpu-per-task-rank1",
        "slurm-binds-one-gpu-per-task-rank3",
        "all-gpus-visible-rank0",
        "all-gpus-visible-rank1",
        "all-gpus-visible-rank3",
        "two-gpus-per-task-rank1",
        "fewer-gpus-than-local-ranks",
        "no-gpu-visible",
    ],
)
def test_training_cuda_device_index(local_rank, device_count, index):
    assert cuda_device_index(local_rank, device_count) == index


@pytest.mark.parametrize(
    ("environ", "hostname", "node"),
    [
        ({"SLURMD_NODENAME": "gpu-node-02"}, "gpu-node-02.cluster.example.com", "gpu-node-02"),
        ({"SLURMD_NODENAME": "n7"}, "other-name", "n7"),
        ({}, "gpu-node-03.cluster.example.com", "gpu-node-03"),
        ({"SLURMD_NODENAME": ""}, "laptop", "laptop"),
    ],
    ids=["slurm-node-name", "slurm-wins-over-hostname", "short-hostname", "empty-slurm-variable"],
)
def test_training_node_name(environ, hostname, node):
    assert node_name(environ, hostname) == node


def test_training_log_format_names_rank_and_node():
    record = logging.LogRecord("hybridtrain", logging.ERROR, __file__, 1, "peer lost", None, None)
    line = logging.Formatter(log_format(1, "gpu-node-02")).format(record)
    assert line.split(" ", 2)[2] == "rank1@gpu-node-02 ERROR hybridtrain: peer lost"


@pytest.mark.parametrize(
    ("ranks", "nodes", "placement"),
    [
        ([{"rank": 0, "node": "vm", "local_rank": 0}], 1, "0@vm"),
        (
            [
                {"rank": 1, "node": "gpu-node-02", "local_rank": 0},
                {"rank": 0, "node": "gpu-node-01", "local_rank": 0},
            ],
            2,
            "0@gpu-node-01, 1@gpu-node-02",
        ),
        (
            [{"rank": r, "node": f"n{r // 2}", "local_rank": r % 2} for r in range(4)],
            2,
            "0@n0, 1@n0, 2@n1, 3@n1",
        ),
    ],
    ids=["one-rank", "two-nodes-out-of-order", "two-nodes-two-gpus-each"],
)
def test_training_describe_ranks(ranks, nodes, placement):
    assert describe_ranks(ranks) == (nodes, placement)


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


def test_training_resume_errors_exit_2_like_invalid_input():
    assert ResumeError("x").exit_code == ExitCode.INVALID_INPUT == 2


@pytest.mark.parametrize(
    ("text", "collective"),
    [
        (
            "RuntimeError: [third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for "
            "recv operation to complete",
            True,
        ),
        (
            "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55996: Connection reset by peer. "
            "This is typically caused by a remote worker hanging",
            True,
        ),
        ("DistStoreError: Timed out after 301 seconds waiting for clients. 1/2 clients joined.", True),
        ("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", True),
        ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x6 and 7x16)", False),
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
    ids=["gloo-timeout", "gloo-peer-died", "rendezvous-timeout", "nccl", "shape-bug", "oom"],
)
def test_training_collective_failure_names_the_cause(text, collective):
    error = collective_failure(text, 300.0)
    if not collective:
        assert error is None
        return
    assert error is not None and error.exit_code == ExitCode.FAILED
    assert str(error).startswith(
        "a collective operation failed (collective_timeout_s=300): another rank is dead, stuck or unreachable"
    )
    assert str(error).endswith(text.splitlines()[0])
