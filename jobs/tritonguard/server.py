"""The guard in front of Triton's HTTP port, and (locally) the supervisor that keeps tritonserver running.

Infer requests are checked (``checks``) and refused with a 4xx before Triton sees them; everything else a client
of the suite uses (health, metadata, config, statistics, the repository API) passes through unchanged. Routes the
suite never uses and a stranger should not reach (shared-memory registration, trace and log settings, generate)
answer 403. While Triton restarts, a request waits for it up to ``upstream_wait_s`` instead of failing at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import web

from .checks import (
    FLOAT_DTYPES,
    BinaryInput,
    Limits,
    ModelSpec,
    RequestRefused,
    check_request,
    non_finite_message,
    split_body,
)

log = logging.getLogger("tritonguard")

INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?/infer")
# Triton endpoints that change server state no client of the suite needs, or that take JSON inputs unchecked.
CLOSED = re.compile(r"/v2/(systemsharedmemory|cudasharedmemory)(/.*)?|/v2/models/[^/]+(/versions/[^/]+)?/"
                    r"generate(_stream)?|/v2/(trace/setting|logging)|/v2/models/[^/]+(/versions/[^/]+)?/trace/setting")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
NUMPY_FLOAT = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
SPEC_TTL_S = 2.0


def first_non_finite(tail: bytes, item: BinaryInput) -> int | None:
    """Index of the first NaN/inf among a binary float input's values, None when all are finite."""
    raw = tail[item.offset:item.offset + item.size]
    if item.datatype == "BF16":  # no numpy dtype: exponent bits all ones is inf or NaN
        bad = (np.frombuffer(raw, "<u2") & 0x7F80) == 0x7F80
    else:
        bad = ~np.isfinite(np.frombuffer(raw, NUMPY_FLOAT[item.datatype]))
    return int(bad.argmax()) if bad.any() else None


@dataclass
class Counters:
    forwarded: int = 0
    refused: int = 0
    upstream_down: int = 0
    last_refusal_log: float = 0.0
    unlogged: int = 0


@dataclass
class Guard:
    upstream: str
    limits: Limits = field(default_factory=Limits)
    upstream_wait_s: float = 30.0
    counters: Counters = field(default_factory=Counters)
    specs: dict = field(default_factory=dict)  # (model, version) -> (fetched_at, ModelSpec | None)
    session: aiohttp.ClientSession | None = None
    stopping: bool = False

    async def start(self, app: web.Application) -> None:
        # No decompression: bodies pass through byte for byte, Content-Encoding included.
        self.session = aiohttp.ClientSession(self.upstream, auto_decompress=False,
                                             connector=aiohttp.TCPConnector(limit=256))

    async def stop(self, app: web.Application) -> None:
        if self.session:
            await self.session.close()
        log.info("guard stopped: forwarded=%d refused=%d upstream_down=%d", self.counters.forwarded,
                 self.counters.refused, self.counters.upstream_down)

    async def model_spec(self, model: str, version: str | None) -> ModelSpec | None:
        key = (model, version)
        cached = self.specs.get(key)
        if cached and time.monotonic() - cached[0] < SPEC_TTL_S:
            return cached[1]
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/config"
        spec = None
        try:
            async with self.session.get(path) as resp:
                if resp.status == 200:
                    spec = ModelSpec.from_config(await resp.json(content_type=None))
        except (aiohttp.ClientError, ValueError, KeyError, TypeError):
            spec = None  # an unknown model or a server restarting: Triton's own answer follows
        self.specs[key] = (time.monotonic(), spec)
        return spec

    def refuse(self, request: web.Request, exc: RequestRefused) -> web.Response:
        self.counters.refused += 1
        now = time.monotonic()
        if now - self.counters.last_refusal_log >= 1.0:  # a flood of bad requests must not flood the log
            more = f" (+{self.counters.unlogged} more refused since the last line)" if self.counters.unlogged else ""
            log.warning("refused %s %s from %s: %d %s%s", request.method, request.path, request.remote,
                        exc.status, str(exc)[:300], more)
            self.counters.last_refusal_log, self.counters.unlogged = now, 0
        else:
            self.counters.unlogged += 1
        return web.json_response({"error": str(exc)}, status=exc.status)

    async def check_infer(self, request: web.Request, body: bytes, model: str, version: str | None) -> None:
        header_length = request.headers.get("Inference-Header-Content-Length")
        infer_request, tail = split_body(body, header_length)
        spec = await self.model_spec(model, version)
        for item in check_request(infer_request, tail, spec, self.limits):
            if item.datatype in FLOAT_DTYPES:
                bad = first_non_finite(tail, item)
                if bad is not None:
                    raise RequestRefused(non_finite_message(item.name, bad))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if CLOSED.fullmatch(path):
            return self.refuse(request, RequestRefused(f"{path} is not served on this port", status=403))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.refuse(request, RequestRefused(
                f"the request is over {request.app['max_request_bytes']} bytes; split the batch", status=413))
        infer = INFER.fullmatch(path)
        if infer and request.method == "POST":
            try:
                await self.check_infer(request, body, infer.group(1), infer.group(2))
            except RequestRefused as exc:
                return self.refuse(request, exc)
        return await self.forward(request, body)

    async def forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        deadline = time.monotonic() + self.upstream_wait_s
        while True:
            try:
                async with self.session.request(request.method, request.rel_url, headers=headers, data=body,
                                                allow_redirects=False) as resp:
                    payload = await resp.read()
                    self.counters.forwarded += 1
                    out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
                    return web.Response(status=resp.status, body=payload, headers=out)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                # Triton is restarting (the supervisor brings it back): wait for it within the budget. A request
                # cut off mid-answer is sent again: infer and the repository calls are idempotent.
                if time.monotonic() >= deadline or self.stopping:
                    self.counters.upstream_down += 1
                    return web.json_response(
                        {"error": f"Triton is not reachable ({type(exc).__name__}); it is restarting, retry"},
                        status=503, headers={"Retry-After": "1"})
                await asyncio.sleep(0.1)


def make_app(guard: Guard, max_request_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_request_bytes)
    app["max_request_bytes"] = max_request_bytes
    app.on_startup.append(guard.start)
    app.on_cleanup.append(guard.stop)
    app.router.add_route("*", "/{tail:.*}", guard.handle)
    return app


class Supervisor:
    """Runs tritonserver and starts it again when it exits, with backoff (1 s doubling to 30 s; back to 1 s after
    a minute up). The model of record comes back with it: the server loads what each config.pbtxt names.

    tritonserver runs in a process group of its own, killed whole once the server has exited: python-backend stubs
    of models loaded after start inherit the server's sockets (its listening socket, the guard's keep-alive
    connections), and an orphan stub of a killed server would hold them open, so a request on such a connection
    would be neither answered nor reset (measured: one held in CLOSE-WAIT for 14 minutes)."""

    def __init__(self, command: list[str]):
        self.command = command
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.restarts = 0

    async def run(self) -> None:
        backoff = 1.0
        while not self.stopping:
            started = time.monotonic()
            self.process = await asyncio.create_subprocess_exec(*self.command, start_new_session=True)
            log.info("tritonserver started (pid %d)", self.process.pid)
            code = await self.process.wait()
            kill_left_behind(self.process.pid)
            if self.stopping:
                return
            if time.monotonic() - started > 60:
                backoff = 1.0
            self.restarts += 1
            log.error("tritonserver exited (%s); restart %d in %.0f s", describe_exit(code), self.restarts, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def stop(self) -> None:
        self.stopping = True
        if self.process and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
            kill_left_behind(self.process.pid)


def kill_left_behind(group: int) -> None:
    """SIGKILL what is left of an exited server's process group (its python-backend stubs)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return  # nothing left: the stubs went with the server
    log.warning("killed the processes tritonserver (pid %d) left behind", group)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


async def upstream_live(guard: Guard) -> None:
    """Until the server behind the guard answers its liveness and readiness probes."""
    while True:
        try:
            async with guard.session.get("/v2/health/ready") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)


async def serve(guard: Guard, host: str, port: int, max_request_bytes: int, supervise: list[str]) -> None:
    # Bound at once (a second guard started by mistake fails here, before it starts a second tritonserver) but
    # listening only once the server is ready: until then a client is refused, as by a server still starting,
    # not held and then answered 503.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # A stop must not wait on clients holding keep-alive connections or requests waiting for the server.
    runner = web.AppRunner(make_app(guard, max_request_bytes), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    supervisor = Supervisor(supervise) if supervise else None
    tasks = [asyncio.create_task(supervisor.run())] if supervisor else []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiting = asyncio.create_task(upstream_live(guard))
    await asyncio.wait([waiting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        await web.SockSite(runner, sock).start()
        log.info("guard on http://%s:%d in front of %s", host, port, guard.upstream)
        await stop.wait()
    waiting.cancel()
    log.info("stopping")
    guard.stopping = True
    stopped = [supervisor.stop()] if supervisor else []
    await asyncio.gather(runner.cleanup(), *stopped)
    for task in tasks:
        task.cancel()
    sock.close()
