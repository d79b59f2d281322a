"""Follows one Slurm job from the triggerer until it ends, over one reused SSH connection."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from functools import cached_property
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.config import ClusterConfig, RecoveryConfig
from hybridflow.exceptions import SlurmConnectionError, SlurmConnectionLost
from hybridflow.hooks.slurm import SlurmAsyncHook
from hybridflow.utils.progress import describe_progress

# A job just submitted can be missing from both scontrol and accounting for a moment.
UNKNOWN_JOB_GRACE_POLLS = 10


class SlurmJobTrigger(BaseTrigger):
    """
    Polls the job (scontrol, then sacct once the controller forgot it) with a backoff that restarts whenever
    the state changes, follows it through requeues, logs its progress file, and yields exactly one event:
    ``{"status": "success"|"failed"|"error", ...}`` with the job's state, exit code, elapsed time and TRES, or
    ``{"status": "stalled", "stall": ...}`` when the stall watch is on (``heartbeat_dir``) and the running job's ranks
    are past their progress deadlines (see :mod:`hybridflow.utils.stalls`); the operator decides what then.

    :param job_id: the Slurm job to follow.
    :param ssh_conn_id: connection to the login node.
    :param requeue_enabled: whether PREEMPTED/NODE_FAIL are followed by a requeue rather than final.
    :param max_requeues: cancel and fail once the job has restarted more often than this.
    :param poll_interval_s: the longest wait between two polls.
    :param reconnect_budget_s: how long SSH may stay unreachable before the trigger gives up (the job runs on).
    :param progress_path: the job's progress JSON on the cluster, logged at most every ``progress_every_s``.
    :param heartbeat_dir: the ranks' heartbeat files on the cluster ("" turns the stall watch off); read while the
        job runs, every quarter of the shortest deadline, at most 30 s apart (file reads only: no load on slurmctld).
    :param stall_timeout_s: the longest progress deadline (0: no watch); ``stall_floor_s``, ``stall_factor`` and
        ``stall_warm_up_steps`` the deadline of a training rank (:class:`~hybridflow.utils.stalls.StallWatch`).
    :param world_size: the job's ranks (one that never reported is among the stopped).
    :param end_marker_dir: where the job's batch shell marks its end (the job's log dir; "" when it does not):
        while the job runs the trigger waits on that file instead of sleeping (:class:`EndWatch`), so a job's end is
        seen within a fraction of a second however long it ran.
    :param recovery_log: the task's recovery log (:mod:`hybridflow.utils.failures`); with ``log_lines`` and
        ``log_tail_lines``: a job that succeeded comes back with its readable log tail and recovery records
        (``handback``) read here in one command, so the resumed task needs no SSH round trip of its own.
    """

    def __init__(
        self,
        job_id: str,
        ssh_conn_id: str,
        requeue_enabled: bool = True,
        max_requeues: int = ClusterConfig.max_requeues,
        poll_interval_s: float = ClusterConfig.poll_interval_s,
        min_poll_interval_s: float = 1.0,
        reconnect_budget_s: float = ClusterConfig.reconnect_budget_s,
        progress_path: str = "",
        progress_every_s: float = 30.0,
        heartbeat_dir: str = "",
        stall_timeout_s: float = 0.0,
        stall_floor_s: float = RecoveryConfig.stall_floor_s,
        stall_factor: float = RecoveryConfig.stall_factor,
        stall_warm_up_steps: int = RecoveryConfig.stall_warm_up_steps,
        world_size: int = 1,
        end_marker_dir: str = "",
        recovery_log: str = "",
        log_lines: int = 200,
        log_tail_lines: int = 40,
    ):
        super().__init__()
        self.job_id = job_id
        self.ssh_conn_id = ssh_conn_id
        self.requeue_enabled = requeue_enabled
        self.max_requeues = max_requeues
        self.poll_interval_s = poll_interval_s
        self.min_poll_interval_s = min_poll_interval_s
        self.reconnect_budget_s = reconnect_budget_s
        self.progress_path = progress_path
        self.progress_every_s = progress_every_s
        self.heartbeat_dir = heartbeat_dir
        self.stall_timeout_s = stall_timeout_s
        self.stall_floor_s = stall_floor_s
        self.stall_factor = stall_factor
        self.stall_warm_up_steps = stall_warm_up_steps
        self.world_size = world_size
        self.end_marker_dir = end_marker_dir
        self.recovery_log = recovery_log
        self.log_lines = log_lines
        self.log_tail_lines = log_tail_lines
        self._ranks_logged: str | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "hybridflow.triggers.slurm.SlurmJobTrigger",
            {
                "job_id": self.job_id,
                "ssh_conn_id": self.ssh_conn_id,
                "requeue_enabled": self.requeue_enabled,
                "max_requeues": self.max_requeues,
                "poll_interval_s": self.poll_interval_s,
                "min_poll_interval_s": self.min_poll_interval_s,
                "reconnect_budget_s": self.reconnect_budget_s,
                "progress_path": self.progress_path,
                "progress_every_s": self.progress_every_s,
                "heartbeat_dir": self.heartbeat_dir,
                "stall_timeout_s": self.stall_timeout_s,
                "stall_floor_s": self.stall_floor_s,
                "stall_factor": self.stall_factor,
                "stall_warm_up_steps": self.stall_warm_up_steps,
                "world_size": self.world_size,
                "end_marker_dir": self.end_marker_dir,
                "recovery_log": self.recovery_log,
                "log_lines": self.log_lines,
                "log_tail_lines": self.log_tail_lines,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = SlurmAsyncHook(self.ssh_conn_id)
        try:
            yield TriggerEvent(await self._follow(hook))
        finally:
            await hook.close()

    async def _follow(self, hook: SlurmAsyncHook) -> dict:
        from hybridflow.utils.slurm_jobs import EndWatch

        watch = EndWatch(self.end_marker_dir, self.poll_interval_s, self.min_poll_interval_s)
        seen: tuple[str, int] | None = None
        unknown_polls = 0
        lost_since: float | None = None
        reconnect_delay = 1.0
        last_progress = 0.0
        last_stall_check = time.monotonic()
        while True:
            try:
                status = await hook.status(self.job_id)
                lost_since, reconnect_delay = None, 1.0
            except SlurmConnectionLost as exc:
                lost_since = lost_since or time.monotonic()
                down_for = time.monotonic() - lost_since
                if down_for > self.reconnect_budget_s:
                    return self._error(
                        f"lost SSH to the login node (connection {self.ssh_conn_id!r}) for {down_for:.0f} s, over the "
                        f"budget of {self.reconnect_budget_s:.0f} s: {exc}. Job {self.job_id} was left running; "
                        "check the login node's sshd, then clear the task: it reattaches to the job"
                    )
                self.log.warning("SSH lost (%s); reconnecting in %.1f s (down %.0f s of %.0f s budget)", exc,
                                 reconnect_delay, down_for, self.reconnect_budget_s)
                await asyncio.sleep(reconnect_delay * random.uniform(0.8, 1.2))
                reconnect_delay = min(reconnect_delay * 2, 15.0)
                continue
            except SlurmConnectionError as exc:
                return self._error(str(exc))

            if status is None:
                unknown_polls += 1
                if unknown_polls > UNKNOWN_JOB_GRACE_POLLS:
                    return self._error(f"Slurm knows no job {self.job_id} (neither scontrol nor sacct)")
            else:
                if (status.state, status.restarts) != seen:
                    seen = (status.state, status.restarts)
                    restarts = f", restarts {status.restarts}" if status.restarts else ""
                    reason = f" ({status.reason})" if status.reason not in ("", "None") else ""
                    self.log.info("Slurm job %s is %s%s%s", self.job_id, status.state, reason, restarts)
                if status.final(self.requeue_enabled):
                    event = status.to_event()
                    event["status"] = "success" if status.succeeded else "failed"
                    if status.succeeded and self.recovery_log:
                        event["handback"] = await self._handback(hook, status)
                    return event
                if status.restarts > self.max_requeues:
                    await hook.run(["scancel", self.job_id])
                    event = status.to_event()
                    event.update(status="failed", message=(
                        f"job {self.job_id} restarted {status.restarts} times, over max_requeues={self.max_requeues}; "
                        "cancelled it"))
                    return event
                if self._stall_watch_due(status, last_stall_check):
                    last_stall_check = time.monotonic()
                    stall = await self._find_stall(hook, status)
                    if stall is not None:
                        return {**status.to_event(), "status": "stalled", "stall": stall.to_event()}
                if self.progress_path and time.monotonic() - last_progress >= self.progress_every_s:
                    last_progress = time.monotonic()
                    await self._log_progress(hook)
            await self._wait(hook, watch, status)

    async def _handback(self, hook: SlurmAsyncHook, status) -> dict | None:
        """The readable tail of the job's logs and the task's recovery records, or None (the task reads them)."""
        from hybridflow.utils.failures import parse_recovery_log
        from hybridflow.utils.job_logs import log_paths, parse_tails, readable_logs, tails_argv

        paths = log_paths(status.stderr_path, status.stdout_path)
        try:
            result = await hook.run(tails_argv([*paths, self.recovery_log], self.log_lines))
        except SlurmConnectionLost:
            return None
        tails = parse_tails(result.stdout)
        if result.returncode != 0 or set(tails) != {*paths, self.recovery_log}:
            return None
        return {"log_tail": readable_logs(paths, tails, self.log_tail_lines)[1],
                "recovery": parse_recovery_log(tails[self.recovery_log])}

    async def _wait(self, hook: SlurmAsyncHook, watch, status) -> None:
        wait = watch.next_wait(status)
        if not wait.marker:
            await asyncio.sleep(wait.seconds)
            return
        stall_watch = self._stall_watch
        window = min(wait.seconds, stall_watch.check_every_s) if stall_watch else wait.seconds
        try:
            if await hook.wait_for_file(wait.marker, window):
                watch.marker_seen(status)
        except SlurmConnectionLost:
            pass  # the next status poll reconnects within the budget, or fails clearly

    @cached_property
    def _stall_watch(self):
        """The watch's settings, or None when it is off (no heartbeat dir, or ``stall_timeout_s`` 0)."""
        from hybridflow.utils.stalls import StallWatch

        if not self.heartbeat_dir:
            return None
        return StallWatch.from_settings({"stall_timeout_s": self.stall_timeout_s, "stall_floor_s": self.stall_floor_s,
                                         "stall_factor": self.stall_factor,
                                         "stall_warm_up_steps": self.stall_warm_up_steps})

    def _stall_watch_due(self, status, last_check: float) -> bool:
        watch = self._stall_watch
        return bool(watch and status.state == "RUNNING" and time.monotonic() - last_check >= watch.check_every_s)

    async def _find_stall(self, hook: SlurmAsyncHook, status):
        from hybridflow.utils.stalls import find_stall, parse_heartbeats, read_heartbeats_argv

        try:
            result = await hook.run(read_heartbeats_argv(self.heartbeat_dir))
        except SlurmConnectionLost:
            return None  # the next status poll reconnects within the budget, or fails clearly
        now, beats = parse_heartbeats(result.stdout)
        if now is None:
            return None
        return find_stall(beats, now=now, job_id=self.job_id, restarts=status.restarts,
                          running_s=status.elapsed_s or 0.0, world_size=self.world_size,
                          watch=self._stall_watch)

    async def _log_progress(self, hook: SlurmAsyncHook) -> None:
        try:
            result = await hook.run(["cat", "--", self.progress_path])
        except SlurmConnectionLost:
            return  # best effort: the next status poll reconnects within the budget, or fails clearly
        if result.returncode != 0:
            return
        try:
            progress = json.loads(result.stdout)
        except ValueError:
            self.log.info("progress file %s is being rewritten; next time", self.progress_path)
            return
        ranks = progress.get("ranks") if isinstance(progress, dict) else None
        if ranks and ranks != self._ranks_logged:
            self._ranks_logged = ranks
            self.log.info("Slurm job %s ranks (rank@node): %s", self.job_id, ranks)
        self.log.info("progress: %s", describe_progress(progress))

    def _error(self, message: str) -> dict:
        return {"status": "error", "job_id": self.job_id, "message": message}

    async def on_kill(self) -> None:
        """The task was marked failed or cleared while deferred: cancel the job (a triggerer restart does not)."""
        hook = SlurmAsyncHook(self.ssh_conn_id)
        try:
            await hook.run(["scancel", self.job_id])
            self.log.info("cancelled Slurm job %s because the task was stopped", self.job_id)
        finally:
            await hook.close()


class SlurmCapacityTrigger(BaseTrigger):
    """Waits until the partition can start a job of the given shape; yields ``{"status": "ready", ...}``."""

    def __init__(self, partition: str, gpus_per_node: int, nodes: int, ssh_conn_id: str, poke_interval_s: float = 30,
                 reconnect_budget_s: float = ClusterConfig.reconnect_budget_s, timeout_s: float = 6 * 3600,
                 started_at: float | None = None):
        super().__init__()
        # Wall-clock start survives a triggerer restart through serialize(), so the deadline does not move.
        self.started_at = started_at if started_at is not None else time.time()
        self.timeout_s = timeout_s
        self.partition = partition
        self.gpus_per_node = gpus_per_node
        self.nodes = nodes
        self.ssh_conn_id = ssh_conn_id
        self.poke_interval_s = poke_interval_s
        self.reconnect_budget_s = reconnect_budget_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("hybridflow.triggers.slurm.SlurmCapacityTrigger", {
            "partition": self.partition, "gpus_per_node": self.gpus_per_node, "nodes": self.nodes,
            "ssh_conn_id": self.ssh_conn_id, "poke_interval_s": self.poke_interval_s,
            "reconnect_budget_s": self.reconnect_budget_s, "timeout_s": self.timeout_s, "started_at": self.started_at,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = SlurmAsyncHook(self.ssh_conn_id)
        last_reason = None
        lost_since: float | None = None
        try:
            while True:
                try:
                    verdict = await hook.capacity(self.partition, self.gpus_per_node, self.nodes)
                    lost_since = None
                except SlurmConnectionLost as exc:
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since > self.reconnect_budget_s:
                        yield TriggerEvent({"status": "error", "message": f"login node unreachable: {exc}"})
                        return
                    await asyncio.sleep(5)
                    continue
                except SlurmConnectionError as exc:
                    yield TriggerEvent({"status": "error", "message": str(exc)})
                    return
                if verdict.can_run_now:
                    yield TriggerEvent({"status": "ready", "reason": verdict.reason, "gpus_free": verdict.gpus_free})
                    return
                if verdict.impossible:
                    yield TriggerEvent({"status": "impossible", "reason": verdict.reason})
                    return
                if verdict.reason != last_reason:
                    self.log.info("waiting for capacity: %s", verdict.reason)
                    last_reason = verdict.reason
                if time.time() - self.started_at > self.timeout_s:
                    yield TriggerEvent({"status": "timeout", "reason": verdict.reason})
                    return
                await asyncio.sleep(self.poke_interval_s)
        finally:
            await hook.close()
