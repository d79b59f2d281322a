"""Waits in the triggerer for a complete checkpoint (the deferrable side of CheckpointSensor)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class CheckpointTrigger(BaseTrigger):
    """
    Polls the checkpoint store until a checkpoint at or after ``min_step`` verifies, then yields
    ``{"status": "found", "name", "step", "path", "metrics"}``; ``{"status": "timeout"}`` past the deadline.
    The store's clients (paramiko, boto3) are synchronous, so each poll runs in a worker thread and never
    blocks the triggerer's event loop.
    """

    def __init__(self, checkpoint_root: str, min_step: int, verify_hashes: bool, ssh_conn_id: str,
                 storage_conn_id: str, poke_interval_s: float, timeout_s: float, started_at: float | None = None):
        super().__init__()
        self.checkpoint_root = checkpoint_root
        self.min_step = min_step
        self.verify_hashes = verify_hashes
        self.ssh_conn_id = ssh_conn_id
        self.storage_conn_id = storage_conn_id
        self.poke_interval_s = poke_interval_s
        self.timeout_s = timeout_s
        self.started_at = started_at if started_at is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("hybridflow.triggers.checkpoint.CheckpointTrigger", {
            "checkpoint_root": self.checkpoint_root, "min_step": self.min_step, "verify_hashes": self.verify_hashes,
            "ssh_conn_id": self.ssh_conn_id, "storage_conn_id": self.storage_conn_id,
            "poke_interval_s": self.poke_interval_s, "timeout_s": self.timeout_s, "started_at": self.started_at,
        })

    def _poll(self) -> dict | None:
        from hybridflow.hooks.checkpoint import newest_complete, open_store

        verdict, rejected = newest_complete(open_store(self.checkpoint_root, self.ssh_conn_id, self.storage_conn_id),
                                            self.min_step, self.verify_hashes)
        for bad in rejected:
            self.log.warning("skipping %s/%s: %s", self.checkpoint_root, bad.name, "; ".join(bad.problems))
        if verdict is None:
            return None
        return {"status": "found", "name": verdict.name, "step": verdict.step,
                "path": f"{self.checkpoint_root.rstrip('/')}/{verdict.name}",
                "metrics": dict(verdict.manifest.get("metrics", {}))}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            found = await asyncio.to_thread(self._poll)
            if found:
                yield TriggerEvent(found)
                return
            if time.time() - self.started_at > self.timeout_s:
                yield TriggerEvent({"status": "timeout", "message": (
                    f"no complete checkpoint at or after step {self.min_step} under {self.checkpoint_root} within "
                    f"{self.timeout_s:.0f} s")})
                return
            await asyncio.sleep(self.poke_interval_s)
