"""The async Slurm hook's reading of a command's end. A test double stands in for the asyncssh connection (the
process boundary): a command cut mid-way by sshd going down cannot be timed against the real server reliably, and
tests/reliability/test_airflow_slurm_faults.py covers the outage itself."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hybridflow.exceptions import SlurmConnectionLost
from hybridflow.hooks.slurm import SlurmAsyncHook


class _Connection:
    def __init__(self, **result):
        self.result = SimpleNamespace(**{"stdout": "", "stderr": "", "exit_signal": None} | result)
        self.closed = False

    async def run(self, command, **kwargs):
        return self.result

    def close(self):
        self.closed = True


def _run(connection, argv):
    hook = SlurmAsyncHook("slurm_test")
    hook._conn = connection
    return asyncio.run(hook.run(argv)), hook


@pytest.mark.parametrize("result, message", [
    ({"exit_status": None}, "ended without an exit status: scontrol show job 7"),
    ({"exit_status": None, "exit_signal": ("KILL", False, "", "")}, r"without an exit status \(signal KILL\)"),
    ({"exit_status": None, "stdout": "JobId=7 JobState=RUNN"}, "ended without an exit status"),
])
def test_a_command_without_exit_status_is_a_lost_connection_not_an_answer(result, message):
    """sshd stopped mid-command: asyncssh reports no exit status and partial (often empty) output."""
    connection = _Connection(**result)
    with pytest.raises(SlurmConnectionLost, match=message):
        _run(connection, ["scontrol", "show", "job", "7"])
    assert connection.closed, "the next poll reconnects"


@pytest.mark.parametrize("status", [0, 1, 255])
def test_a_command_with_an_exit_status_is_its_result(status):
    connection = _Connection(exit_status=status, stdout="out", stderr="err")
    result, hook = _run(connection, ["squeue"])
    assert (result.returncode, result.stdout, result.stderr) == (status, "out", "err")
    assert not connection.closed
