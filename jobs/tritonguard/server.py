"""The guard in front of Triton's HTTP port, and (locally) the supervisor that keeps tritonserver running.

Infer requests are checked (``checks``) and refused with a 4xx before Triton sees them; everything else a client
of the suite uses (health, metadata, config, statistics, the repository API) passes through unchanged. Routes the
suite never uses and a stranger should not reach (shared-memory registration, trace and log settings, generate)
answer 403. While Triton restarts, a request waits for it up to ``upstream_wait_s`` instead of failing at once.

A request that names no version goes where the model's release says (``release``: stable, shadow or canary),
and what each version answered is recorded for the release's judge. The admin port serves ``/metrics``
(Prometheus) and the release API, ``/v1/releases/<model>`` (GET, PUT, DELETE) and ``.../figures``; it is for the
deploy operator and Prometheus, never for clients: bind it where only they reach it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .checks import Limits, ModelSpec, RequestRefused, check_infer_request, split_body
from .metrics import GuardMetrics
from .release import (
    SHADOW,
    STABLE,
    Release,
    ReleaseBook,
    Route,
    release_from_request,
    route,
    scores_from_response,
)

log = logging.getLogger("tritonguard")

INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?/infer")
# Triton endpoints that change server state no client of the suite needs, or that take JSON inputs unchecked.
CLOSED = re.compile(r"/v2/(systemsharedmemory|cudasharedmemory)(/.*)?|/v2/models/[^/]+(/versions/[^/]+)?/"
                    r"generate(_stream)?|/v2/(trace/setting|logging)|/v2/models/[^/]+(/versions/[^/]+)?/trace/setting")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
SPEC_TTL_S = 2.0
MAX_CACHED_SPECS = 4096  # model names come from clients: a flood of made-up ones must not grow memory
MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


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
    releases: ReleaseBook = field(default_factory=ReleaseBook)
    metrics: GuardMetrics = field(default_factory=GuardMetrics)
    shadows: set = field(default_factory=set)  # shadow copies in flight
    max_shadows: int = 64

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
        if len(self.specs) >= MAX_CACHED_SPECS:
            self.specs.clear()
        self.specs[key] = (time.monotonic(), spec)
        return spec

    def model_label(self, model: str | None) -> str:
        """``model`` for a model the server knows, else ``unknown``: metric labels stay bounded."""
        cached = self.specs.get((model, None))
        return model if cached and cached[1] is not None else "unknown"

    def count_refusal(self, model: str | None, protocol: str, reason: str) -> None:
        self.counters.refused += 1
        self.metrics.refused(self.model_label(model), protocol, reason)

    def count_answer(self, model: str, protocol: str, release: Release | None, target: Route | None,
                     requested: int | None, elapsed_s: float, failed: bool, scores: Callable[[], list[float]]) -> None:
        """One forwarded infer request in the metrics and, when it is a judged release step's traffic, in the
        step's figures (``scores`` parses the answer only then)."""
        label = self.model_label(model)
        answered = target.version if target else requested
        version = "unknown" if label == "unknown" else str(answered) if answered is not None else "default"
        self.metrics.observe(label, version, protocol, elapsed_s, failed)
        if release is not None and release.mode != STABLE and requested is None:
            self.releases.record(model, target.version, elapsed_s * 1000, None if failed else scores(), failed)

    def count_shadow(self, model: str, version: int, elapsed_s: float, scores: list[float] | None) -> None:
        """One shadow copy's answer (``scores`` None: it failed)."""
        failed = scores is None
        self.metrics.observe(self.model_label(model), str(version), "shadow", elapsed_s, failed)
        self.releases.record(model, version, elapsed_s * 1000, scores, failed)

    def refuse(self, request: web.Request, exc: RequestRefused, model: str | None = None) -> web.Response:
        self.count_refusal(model, "http", exc.reason)
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
        check_infer_request(infer_request, tail, await self.model_spec(model, version), self.limits)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if CLOSED.fullmatch(path):
            return self.refuse(request, RequestRefused(f"{path} is not served on this port", status=403,
                                                       reason="closed"))
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.refuse(request, RequestRefused(
                f"the request is over {request.app['max_request_bytes']} bytes; split the batch", status=413))
        infer = INFER.fullmatch(path)
        if infer and request.method == "POST":
            model, version = infer.group(1), infer.group(2)
            try:
                await self.check_infer(request, body, model, version)
            except RequestRefused as exc:
                return self.refuse(request, exc, model)
            return await self.infer(request, body, model, int(version) if version else None)
        return await self.forward(request, body)

    async def infer(self, request: web.Request, body: bytes, model: str, requested: int | None) -> web.Response:
        """Forward a checked infer request to the version the release routes it to; record what it answered."""
        release = self.releases.get(model)
        target = route(release, requested) if release else None
        url = request.rel_url
        if target is not None and requested is None:
            url = url.with_path(f"/v2/models/{model}/versions/{target.version}/infer")
        started = time.perf_counter()
        response = await self.forward(request, body, url)
        self.count_answer(model, "http", release, target, requested, time.perf_counter() - started,
                          response.status >= 400, lambda: scores_from_response(
                              response.body, response.headers.get("Inference-Header-Content-Length"),
                              response.headers.get("Content-Encoding")))
        if target is not None and target.shadow is not None:
            self.spawn_shadow(request, body, model, target.shadow)
        return response

    def spawn_shadow(self, request: web.Request, body: bytes, model: str, version: int) -> None:
        if len(self.shadows) >= self.max_shadows:  # the candidate is slower than traffic: drop, never queue
            self.metrics.shadow_dropped.labels(self.model_label(model)).inc()
            return
        task = asyncio.create_task(self.shadow_copy(request, body, model, version))
        self.shadows.add(task)
        task.add_done_callback(self.shadows.discard)

    async def shadow_copy(self, request: web.Request, body: bytes, model: str, version: int) -> None:
        """The request again, to the candidate: its answer is recorded and dropped, never returned."""
        url = request.rel_url.with_path(f"/v2/models/{model}/versions/{version}/infer")
        started = time.perf_counter()
        try:
            async with self.session.post(url, headers=self.forward_headers(request), data=body) as resp:
                payload, status = await resp.read(), resp.status
                header_length = resp.headers.get("Inference-Header-Content-Length")
                encoding = resp.headers.get("Content-Encoding")
        except aiohttp.ClientError:
            payload, status, header_length, encoding = b"", 599, None, None
        self.count_shadow(model, version, time.perf_counter() - started,
                          None if status >= 400 else scores_from_response(payload, header_length, encoding))

    @staticmethod
    def forward_headers(request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        # aiohttp would ask for gzip on the client's behalf: Triton would compress what the client never asked
        # to be (CPU on both sides, for loopback bytes).
        if "accept-encoding" not in map(str.lower, headers):
            headers["Accept-Encoding"] = "identity"
        return headers

    async def forward(self, request: web.Request, body: bytes, url=None) -> web.Response:
        headers = self.forward_headers(request)
        deadline = time.monotonic() + self.upstream_wait_s
        while True:
            try:
                async with self.session.request(request.method, url or request.rel_url, headers=headers, data=body,
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
                    self.metrics.upstream_down.inc()
                    return web.json_response(
                        {"error": f"Triton is not reachable ({type(exc).__name__}); it is restarting, retry"},
                        status=503, headers={"Retry-After": "1"})
                await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ the admin port: metrics and releases
    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def list_releases(self, request: web.Request) -> web.Response:
        return web.json_response({model: self.releases.describe(model) for model in sorted(self.releases.releases)})

    async def release_endpoint(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not MODEL_NAME.fullmatch(model):
            return web.json_response({"error": f"model name {model[:80]!r}: use 1-128 letters, digits, '_', '.', "
                                               "'-'"}, status=400)
        if request.method == "GET":
            described = self.releases.describe(model)
            return web.json_response(described) if described else self.no_release(model)
        if request.method == "DELETE":
            if not self.releases.clear(model):
                return self.no_release(model)
            self.metrics.cleared(model)
            log.info("release of %s cleared: requests without a version go to the server's default", model)
            return web.json_response({"model": model, "cleared": True})
        if request.method != "PUT":
            return web.json_response({"error": "use GET, PUT or DELETE"}, status=405)
        try:
            release = release_from_request(model, json.loads(await request.read()))
        except ValueError as exc:  # JSONDecodeError included
            return web.json_response({"error": f"release of {model}: {exc}"}, status=400)
        generation = self.releases.set(release)
        stable_share = 100 - release.share if release.mode not in (STABLE, SHADOW) else 100
        self.metrics.released(model, release.stable, release.candidate, stable_share)
        log.info("release of %s: %s, stable version %s, candidate %s, candidate share %s%% (generation %d)", model,
                 release.mode, release.stable, release.candidate, 100 - stable_share, generation)
        return web.json_response(self.releases.describe(model))

    async def release_figures(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        figures = self.releases.figures(model) if MODEL_NAME.fullmatch(model) else None
        return web.json_response(figures) if figures else self.no_release(model)

    @staticmethod
    def no_release(model: str) -> web.Response:
        return web.json_response({"error": f"no release of {model[:80]!r} is set on this guard"}, status=404)


def make_admin_app(guard: Guard) -> web.Application:
    app = web.Application(client_max_size=1 << 16)
    app.router.add_get("/metrics", guard.metrics_page)
    app.router.add_get("/v1/releases", guard.list_releases)
    app.router.add_route("*", "/v1/releases/{model}", guard.release_endpoint)
    app.router.add_get("/v1/releases/{model}/figures", guard.release_figures)
    return app


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


async def serve(guard: Guard, host: str, port: int, max_request_bytes: int, supervise: list[str],
                admin: tuple[str, int] | None = None, grpc: tuple[str, int, str] | None = None) -> None:
    """``admin``: where /metrics and the release API listen; ``grpc``: (host, port, Triton's own gRPC address)."""
    # Bound at once (a second guard started by mistake fails here, before it starts a second tritonserver) but
    # listening only once the server is ready: until then a client is refused, as by a server still starting,
    # not held and then answered 503.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # A stop must not wait on clients holding keep-alive connections or requests waiting for the server.
    runner = web.AppRunner(make_app(guard, max_request_bytes), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    admin_runner = web.AppRunner(make_admin_app(guard), access_log=None, shutdown_timeout=1.0)
    await admin_runner.setup()
    if admin:  # at once: metrics and the release API answer while the server starts too
        await web.TCPSite(admin_runner, *admin).start()
        log.info("metrics and releases on http://%s:%d", *admin)
    supervisor = Supervisor(supervise) if supervise else None
    tasks = [asyncio.create_task(supervisor.run())] if supervisor else []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiting = asyncio.create_task(upstream_live(guard))
    await asyncio.wait([waiting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    front = None
    if not stop.is_set():
        await web.SockSite(runner, sock).start()
        log.info("guard on http://%s:%d in front of %s", host, port, guard.upstream)
        if grpc:
            from .grpc_front import GrpcFront

            front = GrpcFront(guard, grpc[2], max_request_bytes)
            await front.start(grpc[0], grpc[1])
        await stop.wait()
    waiting.cancel()
    log.info("stopping")
    guard.stopping = True
    stopped = [supervisor.stop()] if supervisor else []
    stopped += [front.stop()] if front else []
    await asyncio.gather(runner.cleanup(), admin_runner.cleanup(), *stopped)
    for task in tasks:
        task.cancel()
    sock.close()
