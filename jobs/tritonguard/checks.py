"""Checks of one KServe v2 HTTP infer request before Triton sees it (pure: no I/O, table-tested).

Why: the bundled tritonserver 2.51 allocates what a JSON request's `shape` declares before it reads `data`, so
one request declaring [2147483648, 30] ends the server (std::bad_alloc); malformed JSON and wrong dtypes answer
500. A request passes only when every declared size is bounded, agrees with the data sent and with the model's
config, and every float is finite. NaN/inf are refused (400): a score computed from them is NaN or meaningless,
and a caller is better told than handed one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

# Bytes per element of each KServe v2 datatype; BYTES elements have no fixed size.
DTYPE_SIZE = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2, "INT32": 4,
              "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2, "BYTES": None}
FLOAT_DTYPES = {"FP16", "FP32", "FP64", "BF16"}
NUMPY_FLOAT = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
MAX_RANK = 8
MAX_INPUTS = 64


class RequestRefused(Exception):
    """A request the guard answers itself: HTTP ``status`` with ``message`` as Triton's ``{"error": ...}``.
    ``reason``: the class of fault, a label of the refusals metric (malformed, size, shape, dtype, batch,
    non_finite, closed)."""

    def __init__(self, message: str, status: int = 400, reason: str = "malformed"):
        super().__init__(message)
        self.status = status
        self.reason = "size" if status == 413 else reason


@dataclass(frozen=True)
class InputSpec:
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension; -1 is any size
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """What a model accepts, read from Triton's ``GET /v2/models/<name>/config``."""

    max_batch_size: int
    inputs: dict[str, InputSpec]

    @classmethod
    def from_config(cls, config: dict) -> ModelSpec:
        inputs = {}
        for item in config.get("input", []):
            dtype = str(item.get("data_type", "")).removeprefix("TYPE_")
            inputs[item["name"]] = InputSpec("BYTES" if dtype == "STRING" else dtype,
                                             tuple(int(d) for d in item.get("dims", [])),
                                             bool(item.get("optional", False)))
        return cls(int(config.get("max_batch_size", 0)), inputs)


@dataclass(frozen=True)
class Limits:
    max_input_bytes: int = 64 << 20  # one input tensor, as declared by its shape
    max_dim: int = 1 << 31


@dataclass(frozen=True)
class BinaryInput:
    name: str
    datatype: str
    offset: int  # into the binary tail after the JSON header
    size: int


def split_body(body: bytes, header_length: str | None) -> tuple[dict, bytes]:
    """The JSON header and the binary tail (``Inference-Header-Content-Length`` splits them)."""
    if header_length is None:
        head, tail = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise RequestRefused("Inference-Header-Content-Length must be a byte count") from None
        if not 0 <= n <= len(body):
            raise RequestRefused(f"Inference-Header-Content-Length {n} is outside the body of {len(body)} bytes")
        head, tail = body[:n], body[n:]
    try:
        request = json.loads(head)
    except (ValueError, RecursionError) as exc:
        raise RequestRefused(f"the request is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise RequestRefused("the request must be a JSON object with an 'inputs' list")
    return request, tail


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shape(name: str, shape, datatype: str, limits: Limits) -> int:
    """The element count the shape declares, refusing shapes no model could be sent."""
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK:
        raise RequestRefused(f"input {name!r}: 'shape' must be a list of 1 to {MAX_RANK} dimensions")
    if not all(is_int(d) and 0 <= d <= limits.max_dim for d in shape):
        raise RequestRefused(f"input {name!r}: every dimension of 'shape' must be an integer from 0 to "
                             f"{limits.max_dim}; got {shape}", reason="shape")
    count = math.prod(shape)
    if count == 0:
        raise RequestRefused(f"input {name!r}: shape {shape} holds no rows; send at least one", reason="shape")
    declared = count * (DTYPE_SIZE[datatype] or 1)
    if declared > limits.max_input_bytes:
        raise RequestRefused(f"input {name!r}: shape {shape} declares {declared} bytes, over the limit of "
                             f"{limits.max_input_bytes}; split the batch", status=413)
    return count


def check_against_model(name: str, datatype: str, shape: list[int], model: ModelSpec) -> None:
    spec = model.inputs.get(name)
    if spec is None:
        raise RequestRefused(f"unknown input {name!r}; the model takes {sorted(model.inputs)}", reason="shape")
    if datatype != spec.datatype:
        raise RequestRefused(f"input {name!r} is {spec.datatype}, not {datatype}", reason="dtype")
    dims = shape
    if model.max_batch_size > 0:
        if shape[0] > model.max_batch_size:
            raise RequestRefused(f"input {name!r}: batch of {shape[0]} rows is over the model's max_batch_size "
                                 f"{model.max_batch_size}; split it", reason="batch")
        dims = shape[1:]
    if len(dims) != len(spec.dims) or any(want not in (-1, got) for want, got in zip(spec.dims, dims, strict=True)):
        batch = "[batch, " if model.max_batch_size > 0 else "["
        raise RequestRefused(f"input {name!r}: shape {shape} does not fit the model's {batch}"
                             f"{', '.join(map(str, spec.dims))}]", reason="shape")


def flat_values(name: str, data, count: int) -> list:
    """``data`` as a flat list (KServe allows nested rows), refusing a count that disagrees with the shape."""
    flat: list = []
    stack = [iter(data if isinstance(data, list) else [data])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) > MAX_RANK:
                    raise RequestRefused(f"input {name!r}: 'data' is nested deeper than {MAX_RANK} levels")
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > count:
                raise RequestRefused(f"input {name!r}: 'data' holds more than the {count} values its shape declares",
                                     reason="shape")
        else:
            stack.pop()
    if len(flat) != count:
        raise RequestRefused(f"input {name!r}: 'data' holds {len(flat)} values; its shape declares {count}",
                             reason="shape")
    return flat


def check_json_values(name: str, datatype: str, values: list) -> None:
    if datatype == "BYTES":
        ok = all(isinstance(v, str) for v in values)
    elif datatype == "BOOL":
        ok = all(isinstance(v, bool) for v in values)
    elif datatype in FLOAT_DTYPES:
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    else:
        bits = DTYPE_SIZE[datatype] * 8
        low, high = (0, 2**bits - 1) if datatype.startswith("U") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        ok = all(is_int(v) and low <= v <= high for v in values)
    if not ok:
        raise RequestRefused(f"input {name!r}: 'data' holds values that are not {datatype}", reason="dtype")
    if datatype in FLOAT_DTYPES:
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise RequestRefused(non_finite_message(name, i), reason="non_finite")


def non_finite_message(name: str, flat_index: int) -> str:
    return (f"input {name!r} holds NaN or infinity (value {flat_index}); the model scores finite values only: "
            "impute or drop the row")


def check_request(request: dict, tail: bytes, model: ModelSpec | None, limits: Limits = Limits()) -> list[BinaryInput]:
    """Refuse what Triton must not see; return the binary inputs whose floats the caller still checks."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise RequestRefused(f"'inputs' must be a list of 1 to {MAX_INPUTS} tensors")
    binary: list[BinaryInput] = []
    offset = 0
    seen = set()
    for item in inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise RequestRefused("every input must be an object with a 'name'")
        name, datatype = item["name"], item.get("datatype")
        if name in seen:
            raise RequestRefused(f"input {name!r} is given twice")
        seen.add(name)
        if datatype not in DTYPE_SIZE:
            raise RequestRefused(f"input {name!r}: 'datatype' must be one of {', '.join(DTYPE_SIZE)}",
                                 reason="dtype")
        count = check_shape(name, item.get("shape"), datatype, limits)
        if model is not None:
            check_against_model(name, datatype, item["shape"], model)
        parameters = item.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise RequestRefused(f"input {name!r}: 'parameters' must be an object")
        if "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            expected = count * DTYPE_SIZE[datatype] if DTYPE_SIZE[datatype] else None
            if not is_int(size) or size < 0 or (expected is not None and size != expected):
                raise RequestRefused(f"input {name!r}: binary_data_size {size!r} disagrees with shape "
                                     f"{item['shape']} of {datatype} ({expected} bytes)", reason="shape")
            if "data" in item:
                raise RequestRefused(f"input {name!r} has both 'data' and binary_data_size; send one")
            binary.append(BinaryInput(name, datatype, offset, size))
            offset += size
        elif "data" in item:
            check_json_values(name, datatype, flat_values(name, item["data"], count))
        else:
            raise RequestRefused(f"input {name!r} has no 'data' and no binary_data_size")
    if model is not None:
        missing = sorted(n for n, spec in model.inputs.items() if not spec.optional and n not in seen)
        if missing:
            raise RequestRefused(f"the model needs input(s) {missing}", reason="shape")
    if offset != len(tail):
        raise RequestRefused(f"the binary part holds {len(tail)} bytes; the inputs' binary_data_size add up to "
                             f"{offset}", reason="shape")
    return binary


def first_non_finite(tail: bytes, item: BinaryInput) -> int | None:
    """Index of the first NaN/inf among a binary float input's values, None when all are finite."""
    raw = tail[item.offset:item.offset + item.size]
    if item.datatype == "BF16":  # no numpy dtype: exponent bits all ones is inf or NaN
        bad = (np.frombuffer(raw, "<u2") & 0x7F80) == 0x7F80
    else:
        bad = ~np.isfinite(np.frombuffer(raw, NUMPY_FLOAT[item.datatype]))
    return int(bad.argmax()) if bad.any() else None


def check_infer_request(request: dict, tail: bytes, model: ModelSpec | None, limits: Limits = Limits()) -> None:
    """Everything the guard checks of one infer request, whichever protocol brought it: :func:`check_request`,
    then NaN/infinity among binary float values."""
    for item in check_request(request, tail, model, limits):
        if item.datatype in FLOAT_DTYPES:
            bad = first_non_finite(tail, item)
            if bad is not None:
                raise RequestRefused(non_finite_message(item.name, bad), reason="non_finite")
