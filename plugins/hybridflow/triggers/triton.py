"""Loads a model version on Triton and waits until the server says it is ready, from the triggerer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.exceptions import TritonError
from hybridflow.hooks.triton import ServerUnavailable, TritonHook


class TritonModelReadyTrigger(BaseTrigger):
    """
    Asks the server (explicit model control, over gRPC) to load ``model_name`` with the version policy its
    repository config names, then polls until ``version`` is READY. Yields exactly one event:
    ``{"status": "ready"|"failed"|"timeout"|"error"|"restarted", "model", "version", "load_s", "message",
    "versions", "carry"}``
    where ``message`` carries the server's own error text and ``versions`` the model's states and reasons.
    ``restarted``: the server went away meanwhile (restart, crash, shutdown), sent at once so that the task
    points the config back at the previous version before a restarting server reads it.

    :param triton_conn_id: connection of type ``triton``.
    :param model_name: the model to load.
    :param version: the version that must become READY.
    :param timeout_s: how long the load may take, counted from ``started_at``.
    :param load: send the load request (False: only wait for readiness).
    :param poll_interval_s: the longest wait between two readiness polls.
    :param started_at: wall-clock start, kept through a triggerer restart so the deadline does not move.
    :param carry: primitives handed back in the event for the task that resumes.
    """

    def __init__(
        self,
        triton_conn_id: str,
        model_name: str,
        version: int,
        timeout_s: float = 300.0,
        load: bool = True,
        poll_interval_s: float = 1.0,
        started_at: float | None = None,
        carry: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.triton_conn_id = triton_conn_id
        self.model_name = model_name
        self.version = int(version)
        self.timeout_s = timeout_s
        self.load = load
        self.poll_interval_s = poll_interval_s
        self.started_at = started_at if started_at is not None else time.time()
        self.carry = dict(carry or {})
        self._load_started = time.monotonic()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("hybridflow.triggers.triton.TritonModelReadyTrigger", {
            "triton_conn_id": self.triton_conn_id, "model_name": self.model_name, "version": self.version,
            "timeout_s": self.timeout_s, "load": self.load, "poll_interval_s": self.poll_interval_s,
            "started_at": self.started_at, "carry": self.carry,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await self.wait())

    async def wait(self) -> dict[str, Any]:
        """The whole load-and-wait; the operator awaits it directly when it does not defer."""
        hook = TritonHook(self.triton_conn_id)
        try:
            await hook.aconnect()
            control = hook.async_control_client()
        except TritonError as exc:
            return self._event("error", str(exc))
        try:
            return await self._follow(hook, control)
        finally:
            await control.close()

    async def _follow(self, hook: TritonHook, control) -> dict[str, Any]:
        self._load_started = time.monotonic()
        try:
            return await self._load_and_wait(hook, control)
        except ServerUnavailable as exc:
            self.log.warning("%s version %s: the server went away: %s", self.model_name, self.version, exc)
            return self._event("restarted", f"the server went away while {self.model_name} version {self.version} "
                                            f"was loading ({exc})")

    async def _load_and_wait(self, hook: TritonHook, control) -> dict[str, Any]:
        deadline = self.started_at + self.timeout_s
        if self.load:
            # The server answers once every version of the new policy is loaded, or one failed.
            load = asyncio.ensure_future(hook.aload_model(control, self.model_name,
                                                          timeout_s=max(1.0, deadline - time.time())))
            done, _ = await asyncio.wait({load}, timeout=max(0.0, deadline - time.time()))
            if not done:
                load.cancel()
                return await self._timeout(hook, control)
            if isinstance(load.exception(), ServerUnavailable):
                raise load.exception()
            if load.exception() is not None:
                return self._event("failed", str(load.exception()), await self._versions(hook, control))
            # A server told to stop still finishes the load in flight: READY on it would not outlive the restart.
            await hook.acheck_server()
            if await hook.ais_model_ready(control, self.model_name, self.version):
                return self._event("ready", f"{self.model_name} version {self.version} is ready")
            versions = await self._versions(hook, control)
            state = versions.get(str(self.version), {})
            return self._event("failed", f"the load finished but version {self.version} is "
                                         f"{state.get('state') or 'not in the repository index'}: "
                                         f"{state.get('reason') or 'no reason given'}", versions)
        delay = min(0.2, self.poll_interval_s)
        while not await hook.ais_model_ready(control, self.model_name, self.version):
            if time.time() > deadline:
                return await self._timeout(hook, control)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_interval_s)
        return self._event("ready", f"{self.model_name} version {self.version} is ready")

    async def _timeout(self, hook: TritonHook, control) -> dict[str, Any]:
        versions = await self._versions(hook, control)
        state = versions.get(str(self.version), {})
        return self._event("timeout", f"{self.model_name} version {self.version} was not ready after "
                                      f"{self.timeout_s:.0f} s (state {state.get('state') or 'unknown'}: "
                                      f"{state.get('reason') or 'no reason given'})", versions)

    async def _versions(self, hook: TritonHook, control) -> dict[str, dict]:
        try:
            return {str(v): s for v, s in (await hook.amodel_versions(control, self.model_name)).items()}
        except TritonError as exc:
            self.log.warning("cannot read the repository index: %s", exc)
            return {}

    def _event(self, status: str, message: str, versions: dict | None = None) -> dict[str, Any]:
        return {"status": status, "model": self.model_name, "version": self.version,
                "load_s": round(time.monotonic() - self._load_started, 3), "message": message,
                "versions": versions or {}, "carry": self.carry}


class TritonReleaseStepTrigger(BaseTrigger):
    """
    Judges one step of a progressive release (shadow, or a canary share) from the guard's figures of each version
    since the step's release ``generation`` began. Yields exactly one event:
    ``{"status": "pass"|"fail"|"held"|"no_traffic"|"superseded"|"error", "verdict", "seconds", "message",
    "carry"}``.

    ``pass``: both versions answered ``min_requests`` and the candidate stays within every threshold, after at
    least ``min_window_s``. ``fail``: a threshold is broken (judged as soon as there are enough requests).
    ``held``: after ``timeout_s``, the stable version still broke the same absolute limit as the candidate (the
    machine, not the candidate). ``no_traffic``: fewer requests (or latencies for a percentile) than needed after
    ``timeout_s`` (None: wait without limit). ``superseded``: the
    release was changed or cleared by someone else (an on-call rollback). ``error``: the guard did not answer
    for ``timeout_s``.

    :param thresholds: :class:`~hybridflow.utils.release.StepThresholds` as a dict.
    :param started_at: wall-clock start, kept through a triggerer restart.
    """

    def __init__(
        self,
        triton_conn_id: str,
        model_name: str,
        generation: int,
        thresholds: dict[str, Any],
        min_window_s: float,
        timeout_s: float | None,
        poll_interval_s: float = 2.0,
        started_at: float | None = None,
        carry: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.triton_conn_id = triton_conn_id
        self.model_name = model_name
        self.generation = int(generation)
        self.thresholds = dict(thresholds)
        self.min_window_s = min_window_s
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self.started_at = started_at if started_at is not None else time.time()
        self.carry = dict(carry or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("hybridflow.triggers.triton.TritonReleaseStepTrigger", {
            "triton_conn_id": self.triton_conn_id, "model_name": self.model_name, "generation": self.generation,
            "thresholds": self.thresholds, "min_window_s": self.min_window_s, "timeout_s": self.timeout_s,
            "poll_interval_s": self.poll_interval_s, "started_at": self.started_at, "carry": self.carry,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(await self.wait())

    async def wait(self) -> dict[str, Any]:
        from hybridflow.utils.release import FAIL, HOLD, PASS, StepThresholds, VersionFigures, judge

        hook = TritonHook(self.triton_conn_id)
        thresholds = StepThresholds(**self.thresholds)
        verdict, unanswered = None, ""
        try:
            await hook.aconnect()
        except TritonError as exc:
            return self._event("error", str(exc))
        while True:
            elapsed = time.time() - self.started_at
            try:
                figures = await asyncio.to_thread(hook.release_figures, self.model_name)
                unanswered = ""
            except TritonError as exc:
                figures, unanswered = None, str(exc)
            if unanswered:
                if self.timeout_s is not None and elapsed > self.timeout_s:
                    return self._event("error", f"the guard did not answer for {elapsed:.0f} s: {unanswered}")
            elif figures is None or figures.get("generation") != self.generation:
                now = (figures or {}).get("release") or "no release"
                return self._event("superseded", f"the release of {self.model_name} changed under this step "
                                                  f"(generation {self.generation} -> "
                                                  f"{(figures or {}).get('generation', 'cleared')}: {now})")
            else:
                # Off the event loop: the bounds sort thousands of latencies.
                verdict = await asyncio.to_thread(judge, VersionFigures(**figures["stable"]),
                                                  VersionFigures(**figures["candidate"]), thresholds)
                if verdict.outcome == FAIL:
                    return self._event("fail", "; ".join(verdict.reasons), verdict)
                if verdict.outcome == PASS and elapsed >= self.min_window_s:
                    return self._event("pass", "within every threshold", verdict)
                if verdict.outcome != PASS and self.timeout_s is not None and elapsed > self.timeout_s:
                    # Still held when time is up: the machine broke the limits for both versions all along.
                    status = "held" if verdict.outcome == HOLD else "no_traffic"
                    return self._event(status, f"{'; '.join(verdict.reasons)} after {elapsed:.0f} s", verdict)
            await asyncio.sleep(self.poll_interval_s)

    def _event(self, status: str, message: str, verdict=None) -> dict[str, Any]:
        verdict = verdict.as_dict() if verdict else None
        return {"status": status, "message": message, "verdict": verdict,
                "seconds": round(time.time() - self.started_at, 1), "carry": self.carry}
