"""Triton Inference Server hook: the connection, the client and every call to the server's HTTP/gRPC API."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from hybridflow.exceptions import TritonError

if TYPE_CHECKING:
    import numpy as np


class TritonHook(BaseHook):
    """
    Talks to one Triton server through ``tritonclient`` (model control API, health, inference).

    The connection's host/port are the HTTP endpoint; extra ``grpc_port`` names the gRPC one, extra
    ``protocol`` (``http`` or ``grpc``) picks the client, extra ``headers`` are sent with every call, and the
    password, when set, is sent as a bearer token.

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
            "placeholders": {"extra": '{"protocol": "http", "grpc_port": 8001, "headers": {}}'},
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
        conn = self.connection
        if not conn.host:
            raise TritonError(f"connection {self.triton_conn_id!r} has no host; set it to the Triton server's host")
        port = conn.port or 8000
        if self.protocol == "grpc":
            port = int(conn.extra_dejson.get("grpc_port", 8001))
        return f"{conn.host}:{port}"

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

    def _call(self, what: str, fn, *args, **kwargs):
        from tritonclient.utils import InferenceServerException

        try:
            return fn(*args, headers=self.headers or None, **kwargs)
        except InferenceServerException as exc:
            raise TritonError(f"Triton at {self.url}: {what} failed: {exc.message()}") from exc
        except OSError as exc:
            raise TritonError(
                f"Triton at {self.url} is unreachable during {what}: {exc}; check that the server runs and the "
                f"connection {self.triton_conn_id!r} points at it"
            ) from exc

    def is_server_ready(self) -> bool:
        try:
            return bool(self._call("server readiness", self.client.is_server_ready))
        except TritonError:
            return False

    def is_model_ready(self, name: str, version: str | int = "") -> bool:
        try:
            return bool(self._call(f"readiness of {name}", self.client.is_model_ready, name, str(version)))
        except TritonError:
            return False

    def load_model(self, name: str, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        self._call(f"load of model {name}", self.client.load_model, name, config=config, files=files)

    def unload_model(self, name: str) -> None:
        self._call(f"unload of model {name}", self.client.unload_model, name)

    def repository_index(self) -> list[dict]:
        index = self._call("repository index", self.client.get_model_repository_index)
        if self.protocol == "grpc":
            return [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models]
        return list(index)

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

    def _client_module(self):
        if self.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        return module

    def test_connection(self) -> tuple[bool, str]:
        if self.is_server_ready():
            return True, f"Triton at {self.url} is ready"
        return False, f"Triton at {self.url} is not ready"
