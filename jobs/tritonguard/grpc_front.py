"""The guard's gRPC front: Triton's public gRPC port, with the checks and the release split of the HTTP guard.

``ModelInfer`` is parsed, checked as the HTTP guard checks a request (sizes before anything is allocated, dtypes,
shapes, batch bounds, NaN/infinity), routed by the model's release and recorded; a refusal is
``INVALID_ARGUMENT`` (``RESOURCE_EXHAUSTED`` for a size over the limits). The health, metadata, config,
statistics and repository RPCs a client of the suite uses pass through as bytes, unparsed. Streaming inference,
shared-memory registration, trace and log settings answer ``PERMISSION_DENIED``: nobody here needs them and each
lets a stranger change or read server state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from .checks import RequestRefused, check_infer_request
from .release import SCORE_DTYPES, route

if TYPE_CHECKING:
    from .server import Guard

log = logging.getLogger("tritonguard")

SERVICE = "inference.GRPCInferenceService"
PASSED = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
          "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
CLOSED = ("SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
          "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
          "LogSettings")
# Where each datatype's values sit in InferTensorContents (FP16 and BF16 travel only as raw bytes).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def as_kserve(request: pb.ModelInferRequest) -> tuple[dict, bytes]:
    """The request as the HTTP guard's checks read one: the JSON header's ``inputs`` and the binary tail."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestRefused(f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; send "
                             "one per input, or typed contents for all", reason="shape")
    inputs = []
    for index, tensor in enumerate(request.inputs):
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise RequestRefused(f"input {tensor.name!r}: shared memory is not served on this port; send the data",
                                 reason="closed")
        item: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if raw:
            item["parameters"] = {"binary_data_size": len(raw[index])}
        else:
            field = CONTENTS.get(tensor.datatype)
            values = list(getattr(tensor.contents, field)) if field else []
            item["data"] = [v.decode("latin-1") for v in values] if tensor.datatype == "BYTES" else values
        inputs.append(item)
    return {"inputs": inputs}, b"".join(raw)


def scores_of(response: pb.ModelInferResponse) -> list[float]:
    """The first output's float values, raw or typed; [] when it has none."""
    if not response.outputs:
        return []
    first = response.outputs[0]
    if response.raw_output_contents and first.datatype in SCORE_DTYPES:
        return np.frombuffer(response.raw_output_contents[0], SCORE_DTYPES[first.datatype]).astype(float).tolist()
    return list(first.contents.fp32_contents or first.contents.fp64_contents)


class GrpcFront:
    def __init__(self, guard: Guard, upstream: str, max_request_bytes: int):
        self.guard = guard
        options = [("grpc.max_receive_message_length", max_request_bytes),
                   ("grpc.max_send_message_length", max_request_bytes)]
        self.channel = grpc.aio.insecure_channel(upstream, options=options)
        self.upstream = upstream
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, self.handlers()),))
        self.shadows: set[asyncio.Task] = set()

    def handlers(self) -> dict:
        handlers = {name: grpc.unary_unary_rpc_method_handler(self.passer(name)) for name in PASSED}
        handlers.update({name: grpc.unary_unary_rpc_method_handler(self.closed(name)) for name in CLOSED})
        handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer)
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.stream_refused)
        return handlers

    def call(self, name: str):
        """The upstream method, bytes in and out."""
        return self.channel.unary_unary(f"/{SERVICE}/{name}")

    def passer(self, name: str):
        async def passed(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await self.call(name)(request, metadata=forwarded(context), timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
        return passed

    def closed(self, name: str):
        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.guard.count_refusal(None, "grpc", "closed")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name} is not served on this port")
        return refuse

    async def stream_refused(self, requests, context: grpc.aio.ServicerContext):
        self.guard.count_refusal(None, "grpc", "closed")
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            "ModelStreamInfer is not served on this port; send each request with ModelInfer")
        yield b""  # never reached: makes this an async generator, as a stream handler must be

    async def model_infer(self, payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
        guard = self.guard
        try:
            request = pb.ModelInferRequest.FromString(payload)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: a malformed message
            return await self.refuse(context, None, RequestRefused("the request is not a ModelInferRequest"))
        model, requested = request.model_name, request.model_version
        try:
            if requested and not requested.isdigit():
                raise RequestRefused(f"model_version {requested[:40]!r}: give a version number, or none",
                                     reason="shape")
            header, tail = as_kserve(request)
            check_infer_request(header, tail, await guard.model_spec(model, requested or None), guard.limits)
        except RequestRefused as exc:
            return await self.refuse(context, model, exc)
        version = int(requested) if requested else None
        release = guard.releases.get(model)
        target = route(release, version) if release else None
        if target is not None and version is None:
            request.model_version = str(target.version)
            payload = request.SerializeToString()
        started = time.perf_counter()
        answer, error = await self.forward(payload, context)
        guard.count_answer(model, "grpc", release, target, version, time.perf_counter() - started,
                           error is not None, lambda: scores_of(pb.ModelInferResponse.FromString(answer)))
        if target is not None and target.shadow is not None:
            self.spawn_shadow(request, target.shadow, context)
        if error is not None:
            await context.abort(error.code(), error.details() or "")
        return answer

    async def forward(self, payload: bytes, context) -> tuple[bytes | None, grpc.aio.AioRpcError | None]:
        """Triton's answer, waiting for a restarting server up to the guard's budget, as the HTTP guard does."""
        deadline = time.monotonic() + self.guard.upstream_wait_s
        while True:
            try:
                return await self.call("ModelInfer")(payload, metadata=forwarded(context),
                                                     timeout=context.time_remaining()), None
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline or self.guard.stopping:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self.guard.metrics.upstream_down.inc()
                    return None, exc
                await asyncio.sleep(0.1)

    def spawn_shadow(self, request: pb.ModelInferRequest, version: int, context) -> None:
        model = request.model_name
        if len(self.shadows) >= self.guard.max_shadows:
            self.guard.metrics.shadow_dropped.labels(self.guard.model_label(model)).inc()
            return
        request.model_version = str(version)
        task = asyncio.create_task(self.shadow_copy(request.SerializeToString(), model, version, forwarded(context)))
        self.shadows.add(task)
        task.add_done_callback(self.shadows.discard)

    async def shadow_copy(self, payload: bytes, model: str, version: int, metadata) -> None:
        started = time.perf_counter()
        try:
            answer = await self.call("ModelInfer")(payload, metadata=metadata, timeout=60)
            scores = scores_of(pb.ModelInferResponse.FromString(answer))
        except grpc.aio.AioRpcError:
            scores = None
        self.guard.count_shadow(model, version, time.perf_counter() - started, scores)

    async def refuse(self, context, model: str | None, exc: RequestRefused) -> bytes:
        self.guard.count_refusal(model, "grpc", exc.reason)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.status == 413 else grpc.StatusCode.INVALID_ARGUMENT
        await context.abort(code, str(exc))

    async def start(self, host: str, port: int) -> None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.server.add_insecure_port(address) == 0:
            raise OSError(f"cannot listen on {address} for gRPC")
        await self.server.start()
        log.info("gRPC guard on %s in front of %s", address, self.upstream)

    async def stop(self) -> None:
        await self.server.stop(grace=2.0)
        await self.channel.close()


def forwarded(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The caller's metadata (a bearer token, request ids) without the transport's own keys."""
    return tuple((key, value) for key, value in (context.invocation_metadata() or ())
                 if not key.startswith((":", "grpc-")) and key not in ("user-agent", "content-type", "te"))
