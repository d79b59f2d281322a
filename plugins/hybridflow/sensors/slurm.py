"""Gate a stage on free capacity in a Slurm GPU partition."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, conf
from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout

from hybridflow.exceptions import SlurmConnectionError
from hybridflow.utils.slurm import whole_number

if TYPE_CHECKING:
    from airflow.sdk import Context


class SlurmCapacitySensor(BaseSensorOperator):
    """
    Waits until ``partition`` could start a job of ``nodes`` x ``gpus_per_node`` GPUs now (nodes up, GPUs free),
    logging why it waits (node states, free GPUs, pending jobs and Slurm's pending reasons). On timeout the error
    says what capacity was missing. A request no set of the partition's nodes could ever satisfy fails at once
    (no retry), naming the partition's largest node.

    :param partition: Slurm partition (templated).
    :param gpus_per_node: GPUs each node must have free (templated).
    :param deferrable: wait in the triggerer instead of a worker slot (default from ``[operators]
        default_deferrable``).
    """

    template_fields: Sequence[str] = ("partition", "gpus_per_node", "nodes")

    def __init__(self, *, partition: str, gpus_per_node: int | str = 1, nodes: int | str = 1,
                 ssh_conn_id: str = "slurm_ssh",
                 deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False), **kwargs):
        kwargs.setdefault("timeout", timedelta(hours=6).total_seconds())
        kwargs.setdefault("poke_interval", 30)
        super().__init__(**kwargs)
        self.partition = partition
        self.gpus_per_node = gpus_per_node
        self.nodes = nodes
        self.ssh_conn_id = ssh_conn_id
        self.deferrable = deferrable
        self.last_reason = ""

    @cached_property
    def hook(self):
        from hybridflow.hooks.slurm import SlurmHook

        return SlurmHook(self.ssh_conn_id)

    @property
    def shape(self) -> tuple[int, int]:
        """(GPUs per node, nodes) as rendered: the fields are templated, so they may arrive as text."""
        return whole_number(self.gpus_per_node, "gpus_per_node"), whole_number(self.nodes, "nodes")

    def poke(self, context: Context) -> bool:
        verdict = self.hook.capacity(self.partition, *self.shape)
        self.last_reason = verdict.reason
        if verdict.impossible:
            raise AirflowFailException(f"{verdict.reason}. Runbook: include/runbooks/capacity.md")
        self.log.info("%s: %s", "capacity available" if verdict.can_run_now else "waiting", verdict.reason)
        return verdict.can_run_now

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            try:
                return super().execute(context)
            except AirflowSensorTimeout as exc:
                raise self._timeout_error(self.last_reason) from exc
        if self.poke(context):
            return None
        from hybridflow.triggers.slurm import SlurmCapacityTrigger

        self.defer(
            trigger=SlurmCapacityTrigger(partition=self.partition, gpus_per_node=self.shape[0], nodes=self.shape[1],
                                         ssh_conn_id=self.ssh_conn_id,
                                         poke_interval_s=self.poke_interval, timeout_s=self.timeout),
            method_name="execute_complete", timeout=timedelta(seconds=self.timeout + 300),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> None:
        if event.get("status") == "impossible":
            raise AirflowFailException(f"{event.get('reason')}. Runbook: include/runbooks/capacity.md")
        if event.get("status") == "timeout":
            raise self._timeout_error(event.get("reason", ""))
        if event.get("status") != "ready":
            raise SlurmConnectionError(f"capacity check failed: {event.get('message', event)}")
        self.log.info("capacity available: %s", event.get("reason"))

    def _timeout_error(self, last_reason: str) -> AirflowSensorTimeout:
        return AirflowSensorTimeout(
            f"no capacity for {self.nodes} node(s) x {self.gpus_per_node} GPU(s) in {self.partition} within "
            f"{self.timeout:.0f} s. Last seen: {last_reason}. Runbook: include/runbooks/capacity.md"
        )
