"""Waits in the triggerer for a complete checkpoint (the deferrable side of CheckpointSensor)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.config import ClusterConfig
from hybridflow.exceptions import HybridflowError


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What a store that cannot be reached raises (SSH, the network, S3's client): waited out within the budget."""
    import paramiko
    from botocore.exceptions import BotoCoreError

    return HybridflowError, OSError, EOFError, paramiko.SSHException, BotoCoreError


class CheckpointTrigger(BaseTrigger):
    """
    Polls the checkpoint store until a checkpoint at or after ``min_step`` verifies, then yields
    ``{"status": "found", "name", "step", "path", "metrics"}``; ``{"status": "timeout"}`` past the deadline.
    One store (one SSH connection) serves every poll; a store that cannot be reached is opened again, with
    backoff, for up to ``reconnect_budget_s`` (the Slurm triggers' budget), then ``{"status": "error"}``.
    The store's clients (paramiko, boto3) are synchronous, so each poll runs in a worker thread and never
    blocks the triggerer's event loop.
    """

    def __init__(self, checkpoint_root: str, min_step: int, verify_hashes: bool, ssh_conn_id: str,
                 storage_conn_id: str, poke_interval_s: float, timeout_s: float, started_at: float | None = None,
                 reconnect_budget_s: float = ClusterConfig.reconnect_budget_s):
        super().__init__()
        self.checkpoint_root = checkpoint_root
        self.min_step = min_step
        self.verify_hashes = verify_hashes
        self.ssh_conn_id = ssh_conn_id
        self.storage_conn_id = storage_conn_id
        self.poke_interval_s = poke_interval_s
        self.timeout_s = timeout_s
        self.started_at = started_at if started_at is not None else time.time()
        self.reconnect_budget_s = reconnect_budget_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("hybridflow.triggers.checkpoint.CheckpointTrigger", {
            "checkpoint_root": self.checkpoint_root, "min_step": self.min_step, "verify_hashes": self.verify_hashes,
            "ssh_conn_id": self.ssh_conn_id, "storage_conn_id": self.storage_conn_id,
            "poke_interval_s": self.poke_interval_s, "timeout_s": self.timeout_s, "started_at": self.started_at,
            "reconnect_budget_s": self.reconnect_budget_s,
        })

    def _poll(self, store) -> dict | None:
        from hybridflow.hooks.checkpoint import ready_checkpoint

        found = ready_checkpoint(store, self.checkpoint_root, self.min_step, self.verify_hashes, self.log)
        return None if found is None else {"status": "found", **found}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from hybridflow.hooks.checkpoint import open_store

        unreachable = _unreachable_errors()
        store, lost_since, delay = None, None, 1.0
        try:
            while True:
                store = store or open_store(self.checkpoint_root, self.ssh_conn_id, self.storage_conn_id)
                try:
                    found = await asyncio.to_thread(self._poll, store)
                    lost_since, delay = None, 1.0
                except unreachable as exc:
                    await asyncio.to_thread(store.close)
                    store = None
                    lost_since = lost_since or time.monotonic()
                    down_for = time.monotonic() - lost_since
                    if down_for > self.reconnect_budget_s:
                        yield TriggerEvent({"status": "error", "message": (
                            f"the checkpoint store of {self.checkpoint_root} stayed unreachable past the reconnect "
                            f"budget of {self.reconnect_budget_s:.0f} s: {exc}")})
                        return
                    self.log.warning("checkpoint store unreachable (%s); again in %.0f s (down %.0f s of %.0f s)",
                                     exc, delay, down_for, self.reconnect_budget_s)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 15.0)
                    continue
                if found:
                    yield TriggerEvent(found)
                    return
                if time.time() - self.started_at > self.timeout_s:
                    yield TriggerEvent({"status": "timeout", "message": (
                        f"no complete checkpoint at or after step {self.min_step} under {self.checkpoint_root} "
                        f"within {self.timeout_s:.0f} s")})
                    return
                await asyncio.sleep(self.poke_interval_s)
        finally:
            if store is not None:
                await asyncio.to_thread(store.close)
