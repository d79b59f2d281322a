"""Gate a stage on a complete training checkpoint: its manifest verified file by file."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue, conf
from airflow.sdk.exceptions import AirflowSensorTimeout

from hybridflow.exceptions import HybridflowError

if TYPE_CHECKING:
    from airflow.sdk import Context


class CheckpointSensor(BaseSensorOperator):
    """
    Waits for the newest checkpoint under ``checkpoint_root`` (a directory on the cluster's filesystem, read over
    SSH, or an ``s3://`` prefix) whose ``MANIFEST.json`` verifies: every listed file present with its size and,
    unless ``verify_hashes`` is off, its sha256. Incomplete or corrupt newer checkpoints are logged and skipped.
    Returns (and pushes) ``{"name", "step", "path", "metrics"}``. With ``deferrable`` it waits in the triggerer.

    :param checkpoint_root: ``<run_dir>/checkpoints`` or ``s3://bucket/prefix`` (templated).
    :param min_step: only a checkpoint at or after this step counts (templated).
    """

    template_fields: Sequence[str] = ("checkpoint_root", "min_step")

    def __init__(self, *, checkpoint_root: str, min_step: int | str = 0, verify_hashes: bool = True,
                 ssh_conn_id: str = "slurm_ssh", storage_conn_id: str = "storage_s3",
                 deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False), **kwargs):
        kwargs.setdefault("mode", "reschedule")
        kwargs.setdefault("poke_interval", 30)
        super().__init__(**kwargs)
        self.checkpoint_root = checkpoint_root
        self.min_step = min_step
        self.verify_hashes = verify_hashes
        self.ssh_conn_id = ssh_conn_id
        self.storage_conn_id = storage_conn_id
        self.deferrable = deferrable

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        first = self.poke(context)
        if first.is_done:
            return first.xcom_value
        from hybridflow.triggers.checkpoint import CheckpointTrigger

        self.defer(
            trigger=CheckpointTrigger(
                checkpoint_root=self.checkpoint_root, min_step=int(self.min_step), verify_hashes=self.verify_hashes,
                ssh_conn_id=self.ssh_conn_id, storage_conn_id=self.storage_conn_id,
                poke_interval_s=self.poke_interval, timeout_s=self.timeout,
            ),
            method_name="execute_complete", timeout=timedelta(seconds=self.timeout + 300),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        if event.get("status") == "error":  # the store was unreachable: a retry may find it again
            raise HybridflowError(f"{event.get('message')}. Runbook: include/runbooks/training.md")
        if event.get("status") != "found":
            raise AirflowSensorTimeout(f"{event.get('message', event)}. Runbook: include/runbooks/training.md")
        self.log.info("complete checkpoint %s (step %d)", event["name"], event["step"])
        return {k: event[k] for k in ("name", "step", "path", "metrics")}

    def poke(self, context: Context) -> PokeReturnValue:
        from hybridflow.hooks.checkpoint import open_store, ready_checkpoint

        store = open_store(self.checkpoint_root, self.ssh_conn_id, self.storage_conn_id)
        found = ready_checkpoint(store, self.checkpoint_root, int(self.min_step), self.verify_hashes, self.log)
        if found is None:
            self.log.info("no complete checkpoint at or after step %s under %s yet", self.min_step,
                          self.checkpoint_root)
            return PokeReturnValue(is_done=False)
        self.log.info("complete checkpoint %s (step %d)", found["name"], found["step"])
        return PokeReturnValue(is_done=True, xcom_value=found)
