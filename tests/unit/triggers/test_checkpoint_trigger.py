"""CheckpointTrigger's wait: one store for every poll, an unreachable store opened again within the reconnect
budget the Slurm triggers have, then a clear error. The store is a test double: it stands for the SSH or S3 side
(a process boundary), whose real behaviour tests/integration/test_slurm_gates.py covers."""

from __future__ import annotations

import asyncio
import hashlib
import json

import paramiko
import pytest
from hybridflow.config import ClusterConfig
from hybridflow.exceptions import SlurmConnectionError
from hybridflow.triggers.checkpoint import CheckpointTrigger
from hybridflow.triggers.slurm import SlurmCapacityTrigger, SlurmJobTrigger

WEIGHTS = b"w" * 16
MANIFEST = json.dumps({"step": 20, "metrics": {"loss": 0.5}, "files": [
    {"path": "model.pt", "size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}]})


class FlakyStore:
    """A checkpoint store whose listings fail with ``error`` while ``failures_left`` (over every store opened)
    lasts, then show step_20."""

    opened: list[FlakyStore] = []
    failures_left = 0

    def __init__(self, error: BaseException):
        self.error, self.closed = error, False
        FlakyStore.opened.append(self)

    def step_dirs(self) -> list[str]:
        if FlakyStore.failures_left > 0:
            FlakyStore.failures_left -= 1
            raise self.error
        return ["step_20"]

    def manifest_text(self, name: str) -> str | None:
        return MANIFEST

    def observe(self, name: str, paths: list[str], with_hashes: bool):
        return {"model.pt": len(WEIGHTS)}, {"model.pt": hashlib.sha256(WEIGHTS).hexdigest()}

    def close(self) -> None:
        self.closed = True


def wait(monkeypatch, failures: int, error: BaseException, budget_s: float) -> dict:
    FlakyStore.opened, FlakyStore.failures_left = [], failures
    monkeypatch.setattr("hybridflow.hooks.checkpoint.open_store", lambda *args: FlakyStore(error))
    monkeypatch.setattr("hybridflow.triggers.checkpoint.asyncio.sleep", _no_sleep)
    trigger = CheckpointTrigger(checkpoint_root="/runs/r/checkpoints", min_step=20, verify_hashes=True,
                                ssh_conn_id="slurm_ssh", storage_conn_id="storage_s3", poke_interval_s=1,
                                timeout_s=600, reconnect_budget_s=budget_s)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first_event())


REAL_SLEEP = asyncio.sleep


async def _no_sleep(_seconds: float) -> None:
    await REAL_SLEEP(0)  # the backoff's length is not under test: no test waits it out


def test_checkpoint_trigger_finds_the_checkpoint_with_one_store_and_closes_it(monkeypatch):
    event = wait(monkeypatch, failures=0, error=OSError(), budget_s=300)
    assert event["status"] == "found" and event["step"] == 20 and event["metrics"] == {"loss": 0.5}
    assert len(FlakyStore.opened) == 1 and FlakyStore.opened[0].closed


@pytest.mark.parametrize("error", [OSError("Connection reset by peer"), EOFError(),
                                   paramiko.SSHException("Timeout opening channel."), SlurmConnectionError("no route")],
                         ids=["reset", "eof", "channel", "ssh-hook"])
def test_checkpoint_trigger_reopens_an_unreachable_store_within_the_budget(monkeypatch, error):
    event = wait(monkeypatch, failures=3, error=error, budget_s=300)
    assert event["status"] == "found" and event["step"] == 20
    assert len(FlakyStore.opened) == 4, "each failure should drop the store and open a fresh one"
    assert all(store.closed for store in FlakyStore.opened)


def test_checkpoint_trigger_gives_up_past_the_budget_naming_the_store_and_the_error(monkeypatch):
    event = wait(monkeypatch, failures=10**6, error=OSError("Connection refused"), budget_s=0)
    assert event["status"] == "error"
    assert "/runs/r/checkpoints" in event["message"] and "Connection refused" in event["message"]
    assert "reconnect budget of 0 s" in event["message"]


def test_checkpoint_trigger_does_not_wait_out_a_bug(monkeypatch):
    with pytest.raises(KeyError):
        wait(monkeypatch, failures=1, error=KeyError("a bug, not the network"), budget_s=300)


def test_every_trigger_rides_out_the_same_reconnect_budget():
    budgets = {cls.__name__: cls.__init__.__defaults__ for cls in (CheckpointTrigger, SlurmCapacityTrigger)}
    assert ClusterConfig.reconnect_budget_s == 300
    assert all(ClusterConfig.reconnect_budget_s in defaults for defaults in budgets.values()), budgets
    job = SlurmJobTrigger(job_id="1", ssh_conn_id="slurm_ssh")
    assert job.reconnect_budget_s == ClusterConfig.reconnect_budget_s
    checkpoint = CheckpointTrigger("/r", 1, True, "slurm_ssh", "storage_s3", 1, 60)
    assert checkpoint.serialize()[1]["reconnect_budget_s"] == ClusterConfig.reconnect_budget_s
