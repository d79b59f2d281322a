"""Triton Inference Server: the hook (connection, client, every call to the server's HTTP/gRPC API). The model
repository it serves from is :mod:`hybridflow.hooks.model_repository`.
"""

from __future__ import annotations

import asyncio
import http.client
import time
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from hybridflow.exceptions import TritonError
from hybridflow.utils.latency import LatencySummary, summarize
from hybridflow.utils.triton import INPUT_NAME, OUTPUT_NAME, model_status_url, versions_of

if TYPE_CHECKING:
    import numpy as np


class ServerUnavailable(TritonError):
    """The server did not answer: down, restarting or shutting down. It says nothing about the model: the deploy
    waits for the server and rolls back instead of judging the version on it."""


def _unavailable(exc) -> bool:
    """gRPC's UNAVAILABLE is the transport's (refused, reset) or a server shutting down ("Server exiting"); HTTP
    503 is the guard in front of the server while it restarts. Triton answers a model that is missing or failed
    with NOT_FOUND, INVALID_ARGUMENT or INTERNAL (HTTP 400)."""
    status = getattr(exc, "status", None)
    return (callable(status) and status() in ("StatusCode.UNAVAILABLE", "503")) or isinstance(exc, ConnectionError)


def _unavailable_in_flight(exc: BaseException) -> bool:
    """A request of the asyncio clients that met no server: refused, reset or cut (OSError, aiohttp's connection
    errors), or the gRPC/HTTP status of a server restarting."""
    import aiohttp

    return isinstance(exc, (OSError, aiohttp.ClientConnectionError)) or _unavailable(exc)


class TritonHook(BaseHook):
    """
    Talks to one Triton server through ``tritonclient`` (model control API, health, inference).

    The connection's host/port are the HTTP endpoint; extra ``grpc_port`` names the gRPC one, extra
    ``protocol`` (``http`` or ``grpc``) picks the client, extra ``headers`` are sent with every call, and the
    password, when set, is sent as a bearer token. Extra ``guard_port`` names the guard's admin port (its
    ``/metrics`` and the release API that splits unversioned traffic between versions: progressive releases).

    Model control (load, unload) always goes over gRPC: while the server handles an HTTP load request its HTTP
    endpoint stalls every other HTTP request, inference included (measured here: 4-5 s, the whole load), whereas
    a gRPC load leaves HTTP and gRPC inference answering in milliseconds.

    :param triton_conn_id: Airflow connection of type ``triton``.
    :param protocol: overrides the connection's ``protocol`` extra.
    :param timeout_s: network timeout of each call.
    """

    conn_name_attr = "triton_conn_id"
    default_conn_name = "triton_default"
    conn_type = "triton"
    hook_name = "Triton Inference Server"

    def __init__(self, triton_conn_id: str = default_conn_name, protocol: str | None = None, timeout_s: float = 60):
        super().__init__()
        self.triton_conn_id = triton_conn_id
        self._protocol = protocol
        self.timeout_s = timeout_s

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login"],
            "relabeling": {"host": "Server host", "port": "HTTP port", "password": "Bearer token (optional)"},
            "placeholders": {"extra": '{"protocol": "http", "grpc_port": 8001, "guard_port": 8003, "headers": {}}'},
        }

    @cached_property
    def connection(self):
        return self.get_connection(self.triton_conn_id)

    @property
    def protocol(self) -> str:
        protocol = self._protocol or self.connection.extra_dejson.get("protocol", "http")
        if protocol not in ("http", "grpc"):
            raise TritonError(
                f"connection {self.triton_conn_id!r}: extra 'protocol' is {protocol!r}; use 'http' or 'grpc'"
            )
        return protocol

    @property
    def url(self) -> str:
        """``host:port`` of the endpoint for the chosen protocol."""
        return self.http_url if self.protocol == "http" else self.grpc_url

    @property
    def http_url(self) -> str:
        return f"{self._host()}:{self.connection.port or 8000}"

    @property
    def grpc_url(self) -> str:
        port = self.connection.extra_dejson.get("grpc_port", 8001)
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise TritonError(f"connection {self.triton_conn_id!r}: extra 'grpc_port' is {port!r}; give the "
                              "server's gRPC port as a number") from None
        return f"{self._host()}:{port}"

    @property
    def guard_url(self) -> str | None:
        """``http://host:port`` of the guard's admin port (metrics, releases); None when the connection names none."""
        port = self.connection.extra_dejson.get("guard_port")
        if port in (None, ""):
            return None
        if isinstance(port, bool) or not str(port).isdigit() or not 0 < int(port) < 65536:
            raise TritonError(f"connection {self.triton_conn_id!r}: extra 'guard_port' is {port!r}; give the "
                              "guard's admin port as a number")
        return f"http://{self._host()}:{int(port)}"

    def _host(self) -> str:
        if not self.connection.host:
            raise TritonError(f"connection {self.triton_conn_id!r} has no host; set it to the Triton server's host")
        return self.connection.host

    @property
    def http_base_url(self) -> str:
        """``http://host:port`` of the HTTP endpoint (status pages, links), whatever the protocol."""
        return f"http://{self.http_url}"

    def model_status_url(self, name: str, version: int | str | None = None) -> str:
        return model_status_url(self.http_base_url, name, version)

    @property
    def headers(self) -> dict[str, str]:
        headers = dict(self.connection.extra_dejson.get("headers") or {})
        if self.connection.password:
            headers["Authorization"] = f"Bearer {self.connection.password}"
        return headers

    def get_conn(self):
        """A ``tritonclient`` client for the connection's protocol (imported lazily: DAG parsing stays fast)."""
        if self.protocol == "grpc":
            import tritonclient.grpc as grpcclient

            return grpcclient.InferenceServerClient(url=self.url)
        import tritonclient.http as httpclient

        return httpclient.InferenceServerClient(
            url=self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
        )

    @cached_property
    def client(self):
        return self.get_conn()

    @cached_property
    def control_client(self):
        """The gRPC client that loads and unloads models (see the class notes: HTTP control stalls HTTP)."""
        if self.protocol == "grpc":
            return self.client
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(url=self.grpc_url)

    def close(self) -> None:
        for name in ("client", "control_client"):
            client = self.__dict__.pop(name, None)
            if client is not None:
                client.close()

    def _call(self, what: str, fn, *args, url: str | None = None, **kwargs):
        from tritonclient.utils import InferenceServerException

        url = url or self.url
        try:
            return fn(*args, headers=self.headers or None, **kwargs)
        except InferenceServerException as exc:
            error = ServerUnavailable if _unavailable(exc) else TritonError
            raise error(f"Triton at {url}: {what} failed: {exc.message()}") from exc
        except TimeoutError as exc:  # an OSError too, but a hung server is not one that went away
            raise TritonError(f"Triton at {url} did not answer in time during {what}: {exc!r}") from exc
        except (OSError, http.client.HTTPException) as exc:  # geventhttpclient: a closed connection is the latter
            raise ServerUnavailable(
                f"Triton at {url} is unreachable during {what}: {exc}; check that the server runs and the "
                f"connection {self.triton_conn_id!r} points at it"
            ) from exc

    def is_server_ready(self) -> bool:
        try:
            return bool(self._call("server readiness", self.client.is_server_ready))
        except TritonError:
            return False

    def check_server(self) -> None:
        """Raises :class:`ServerUnavailable` unless the server says it is ready on a new HTTP connection: a
        server told to stop refuses new connections at once, but for up to its exit timeout it still answers,
        ready, on the connections it has and on gRPC."""
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(url=self.http_url, connection_timeout=10, network_timeout=10)
        try:
            ready = self._call("server readiness", client.is_server_ready, url=self.http_url)
        finally:
            client.close()
        if not ready:
            raise ServerUnavailable(f"Triton at {self.http_url} is not ready: it is shutting down or starting")

    def wait_server_ready(self, timeout_s: float, poll_interval_s: float = 1.0) -> float | None:
        """Seconds until :meth:`check_server` passes, or None after ``timeout_s``. The cached clients are
        dropped: a gRPC channel that saw the server go away backs off for up to minutes before it tries again."""
        started = time.monotonic()
        self.close()
        while True:
            try:
                self.check_server()
                return time.monotonic() - started
            except TritonError:
                if time.monotonic() - started > timeout_s:
                    return None
            time.sleep(poll_interval_s)

    def is_model_ready(self, name: str, version: str | int = "") -> bool:
        try:
            return bool(self._call(f"readiness of {name}", self.client.is_model_ready, name, str(version)))
        except TritonError:
            return False

    def load_model(self, name: str, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        """Explicit-mode load, or reload to apply a changed version policy: the versions already loaded keep
        serving until their replacements are ready. Returns once the server is done (raises with its message)."""
        self._call(f"load of model {name}", self.control_client.load_model, name, config=config, files=files,
                   url=self.grpc_url)

    def unload_model(self, name: str) -> None:
        """Unload every version of the model (explicit mode)."""
        self._call(f"unload of model {name}", self.control_client.unload_model, name, url=self.grpc_url)

    def repository_index(self) -> list[dict]:
        index = self._call("repository index", self.client.get_model_repository_index)
        if self.protocol == "grpc":
            return [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models]
        return list(index)

    def model_versions(self, name: str) -> dict[int, dict]:
        """``{version: {"state": READY|UNAVAILABLE|LOADING|..., "reason": the server's message}}`` of one model."""
        return versions_of(self.repository_index(), name)

    def ready_versions(self, name: str) -> list[int]:
        return sorted(v for v, s in self.model_versions(name).items() if s["state"] == "READY")

    def infer(self, name: str, batch: np.ndarray, version: str | int = "", input_name: str = "INPUT__0",
              output_name: str = "OUTPUT__0") -> np.ndarray:
        """One request of a float32 batch; returns the output tensor."""
        import numpy as np

        module = self._client_module()
        data = np.ascontiguousarray(batch, dtype=np.float32)
        infer_input = module.InferInput(input_name, list(data.shape), "FP32")
        if self.protocol == "http":
            infer_input.set_data_from_numpy(data, binary_data=True)
            requested = [module.InferRequestedOutput(output_name, binary_data=True)]
        else:
            infer_input.set_data_from_numpy(data)
            requested = [module.InferRequestedOutput(output_name)]
        result = self._call(
            f"inference on {name}", self.client.infer, name, [infer_input], model_version=str(version),
            outputs=requested,
        )
        return result.as_numpy(output_name)

    # ------------------------------------------------------------------------------ the guard's releases
    def _guard(self, method: str, path: str, document: dict | None = None) -> dict | None:
        """One call to the guard's release API; None when it answers 404 (no release of the model)."""
        import json
        import urllib.error
        import urllib.request

        base = self.guard_url
        if base is None:
            raise TritonError(f"connection {self.triton_conn_id!r} has no extra 'guard_port': releases are set on "
                              "the guard's admin port; add it, or deploy with serving.release.strategy: direct")
        body = json.dumps(document).encode() if document is not None else None
        request = urllib.request.Request(f"{base}{path}", data=body, method=method,
                                         headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 30)) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            detail = exc.read().decode(errors="replace")[:500]
            raise TritonError(f"the guard at {base} refused {method} {path}: {exc.code} {detail}") from exc
        except (OSError, ValueError) as exc:
            raise ServerUnavailable(f"the guard at {base} did not answer {method} {path}: {exc}; check that it runs "
                                    f"and that connection {self.triton_conn_id!r} names its admin port") from exc

    def set_release(self, name: str, stable: int, candidate: int | None = None, mode: str = "stable",
                    share: int = 0) -> dict:
        """Route ``name``'s unversioned requests: all to ``stable``, or a shadow copy / canary ``share`` percent to
        ``candidate``. Returns the release with its ``generation`` (figures count from it)."""
        return self._guard("PUT", f"/v1/releases/{name}",
                           {"stable": stable, "candidate": candidate, "mode": mode, "share": share})

    def clear_release(self, name: str) -> bool:
        """Stop routing ``name`` (unversioned requests then go to the server's own choice)."""
        return self._guard("DELETE", f"/v1/releases/{name}") is not None

    def release(self, name: str) -> dict | None:
        return self._guard("GET", f"/v1/releases/{name}")

    def release_figures(self, name: str) -> dict | None:
        """The release and what its stable and candidate versions answered since its generation began."""
        return self._guard("GET", f"/v1/releases/{name}/figures")

    def _client_module(self):
        if self.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        return module

    # ------------------------------------------------------------------------------------------ async side
    async def aconnect(self) -> None:
        """Look the connection up without blocking the event loop (triggers); the sync properties then work."""
        if "connection" not in self.__dict__:
            self.connection = await self.aget_connection(self.triton_conn_id)

    def async_client(self, timeout_s: float | None = None):
        """A ``tritonclient`` asyncio client of the connection's protocol (aiohttp, grpc.aio); the caller closes it."""
        if self.protocol == "grpc":
            return self.async_control_client()
        import tritonclient.http.aio as http_aio

        return http_aio.InferenceServerClient(url=self.url, conn_timeout=timeout_s or self.timeout_s)

    def async_control_client(self):
        """The grpc.aio client for model control, readiness and the repository index; the caller closes it."""
        import tritonclient.grpc.aio as grpc_aio

        return grpc_aio.InferenceServerClient(url=self.grpc_url)

    async def _acall(self, what: str, coro):
        from tritonclient.utils import InferenceServerException

        try:
            return await coro
        except InferenceServerException as exc:
            error = ServerUnavailable if _unavailable(exc) else TritonError
            raise error(f"Triton at {self.grpc_url}: {what} failed: {exc.message()}") from exc
        except TimeoutError as exc:  # an OSError too, but a hung server is not one that went away
            raise TritonError(f"Triton at {self.grpc_url} did not answer in time during {what}: {exc!r}") from exc
        except OSError as exc:
            raise ServerUnavailable(f"Triton at {self.grpc_url} is unreachable during {what}: {exc!r}") from exc

    async def aload_model(self, control, name: str, timeout_s: float | None = None) -> None:
        await self._acall(f"load of model {name}",
                          control.load_model(name, headers=self.headers or None, client_timeout=timeout_s))

    async def ais_model_ready(self, control, name: str, version: int | str = "") -> bool:
        """False while the version is not ready; raises :class:`ServerUnavailable` when the server is away."""
        try:
            return bool(await self._acall(f"readiness of {name}",
                                          control.is_model_ready(name, str(version), headers=self.headers or None)))
        except ServerUnavailable:
            raise
        except TritonError:
            return False

    async def acheck_server(self) -> None:
        """:meth:`check_server` without blocking the event loop (triggers)."""
        import tritonclient.http.aio as http_aio

        client = http_aio.InferenceServerClient(url=self.http_url, conn_timeout=10)
        try:
            ready = await client.is_server_ready(headers=self.headers or None)
        except Exception as exc:  # refused, reset, closed or timed out: it is not answering
            raise ServerUnavailable(f"Triton at {self.http_url} is unreachable during server readiness: "
                                    f"{type(exc).__name__}: {exc}") from exc
        finally:
            await client.close()
        if not ready:
            raise ServerUnavailable(f"Triton at {self.http_url} is not ready: it is shutting down or starting")

    async def amodel_versions(self, control, name: str) -> dict[int, dict]:
        index = await self._acall("repository index", control.get_model_repository_index(
            headers=self.headers or None, as_json=True))
        return versions_of(index.get("models", []), name)

    def measure_latency(self, name: str, version: int | str, rows: Sequence[Sequence[float]], *, concurrency: int,
                        requests: int, batch_size: int = 1, timeout_s: float = 10.0, warmup: int = 0,
                        confidence: float = 0.95) -> LatencySummary:
        """A short load: ``requests`` requests of ``batch_size`` rows cycling over ``rows``, ``concurrency`` in
        flight, through the asyncio client of the connection's protocol; the first ``warmup`` answers are left out
        of the percentiles. Failed requests are counted, not raised."""
        return self.measure_latencies(name, [version], rows, concurrency=concurrency, requests=requests,
                                      batch_size=batch_size, timeout_s=timeout_s, warmup=warmup,
                                      confidence=confidence)[0][0]

    def measure_latencies(self, name: str, versions: Sequence[int | str], rows: Sequence[Sequence[float]], *,
                          concurrency: int, requests: int, batch_size: int = 1, timeout_s: float = 10.0,
                          warmup: int = 0, confidence: float = 0.95) -> list[tuple[LatencySummary, list[float]]]:
        """The same load on each of ``versions`` at once (the same window, the same machine): per version, its
        summary and its latencies in ms after the warm-up."""
        async def both():
            return await asyncio.gather(*(self._load(name, str(v), rows, concurrency, requests, batch_size,
                                                     timeout_s) for v in versions))

        results = []
        for latencies, failed, wall in asyncio.run(both()):
            summary = summarize(latencies, wall, concurrency, failed=failed, warmup=warmup, confidence=confidence)
            results.append((summary, [value * 1000 for value in latencies[summary.warmup:]]))
        return results

    async def _load(self, name: str, version: str, rows, concurrency: int, requests: int, batch_size: int,
                    timeout_s: float) -> tuple[list[float], int, float]:
        """(latencies in s in the order they ended, failed requests, wall seconds) of one load."""
        import numpy as np

        if self.protocol == "grpc":
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.http.aio as module
        client = self.async_client(timeout_s)
        cycled = [rows[i % len(rows)] for i in range(max(len(rows), batch_size))]
        batches = [np.asarray(cycled[i:i + batch_size], dtype=np.float32)
                   for i in range(0, len(cycled) - batch_size + 1, batch_size)]
        latencies: list[float] = []
        failures: list[str] = []
        unavailable: list[str] = []
        next_request = iter(range(requests))

        def request_inputs(i: int):
            infer_input = module.InferInput(INPUT_NAME, list(batches[i % len(batches)].shape), "FP32")
            if self.protocol == "http":
                infer_input.set_data_from_numpy(batches[i % len(batches)], binary_data=True)
                return [infer_input], [module.InferRequestedOutput(OUTPUT_NAME, binary_data=True)]
            infer_input.set_data_from_numpy(batches[i % len(batches)])
            return [infer_input], [module.InferRequestedOutput(OUTPUT_NAME)]

        async def worker() -> None:
            for i in next_request:
                inputs, outputs = request_inputs(i)
                started = time.perf_counter()
                try:
                    await client.infer(name, inputs, model_version=version, outputs=outputs,
                                       headers=self.headers or None)
                except Exception as exc:  # every failure counts against the gate; the first few are logged
                    failures.append(repr(exc))
                    if _unavailable_in_flight(exc):
                        unavailable.append(repr(exc))
                    continue
                latencies.append(time.perf_counter() - started)

        try:
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - started
        finally:
            await client.close()
        for failure in failures[:3]:
            self.log.warning("latency load: request to %s version %s failed: %s", name, version, failure)
        if unavailable:
            # Requests that met no server say nothing about the version: the server restarted under the load.
            raise ServerUnavailable(f"Triton at {self.url}: {len(unavailable)} of {requests} requests of the latency "
                                    "load met no server (refused, cut or 503: restarting)")
        return latencies, len(failures), wall

    def test_connection(self) -> tuple[bool, str]:
        if self.is_server_ready():
            return True, f"Triton at {self.url} is ready"
        return False, f"Triton at {self.url} is not ready"
