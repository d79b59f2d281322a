"""The Triton guard's request checks, by table: each class of hostile infer request is refused with a clear 4xx,
valid requests pass. The real-server proof is tests/reliability/test_triton_hostile_requests.py."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from tritonguard.checks import Limits, ModelSpec, RequestRefused, check_request, first_non_finite, split_body
from tritonguard.server import CLOSED, INFER

MODEL = ModelSpec.from_config({
    "max_batch_size": 256,
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [30]}],
})
ROW = [0.5] * 30


def json_input(shape, data, datatype="FP32", name="INPUT__0", **extra) -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data, **extra}


def binary_input(shape, size, datatype="FP32", name="INPUT__0") -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": size}}


VALID = [
    ("one row", [json_input([1, 30], ROW)], b""),
    ("nested rows", [json_input([2, 30], [ROW, ROW])], b""),
    ("full batch", [json_input([256, 30], ROW * 256)], b""),
    ("integers for floats", [json_input([1, 30], [1] * 30)], b""),
    ("binary", [binary_input([2, 30], 240)], np.ones((2, 30), np.float32).tobytes()),
]


@pytest.mark.parametrize(("case", "inputs", "tail"), VALID, ids=[v[0] for v in VALID])
def test_valid_request_passes(case, inputs, tail):
    check_request({"inputs": inputs}, tail, MODEL)


REFUSED = [
    # (case, inputs, tail, status, words in the message)
    ("huge declared shape, JSON", [json_input([2147483648, 30], ROW)], b"", 413, "declares 257698037760 bytes"),
    ("huge declared shape, binary", [binary_input([2147483648, 30], 120)], b"\0" * 120, 413, "over the limit"),
    ("dimension over 2^31", [json_input([2**40, 30], ROW)], b"", 400, "integer from 0 to"),
    ("30-digit dimension", [json_input([10**30, 30], ROW)], b"", 400, "integer from 0 to"),
    ("negative dimension", [json_input([-1, 30], ROW)], b"", 400, "integer from 0 to"),
    ("float dimension", [json_input([1.0, 30], ROW)], b"", 400, "integer from 0 to"),
    ("bool dimension", [json_input([True, 30], ROW)], b"", 400, "integer from 0 to"),
    ("string shape", [json_input("1,30", ROW)], b"", 400, "'shape' must be a list"),
    ("rank 9", [json_input([1] * 9, [0.5])], b"", 400, "'shape' must be a list of 1 to 8"),
    ("empty shape", [json_input([], [])], b"", 400, "'shape' must be a list"),
    ("empty batch", [json_input([0, 30], [])], b"", 400, "holds no rows"),
    ("too few values", [json_input([2, 30], ROW)], b"", 400, "holds 30 values; its shape declares 60"),
    ("too many values", [json_input([1, 30], ROW * 2)], b"", 400, "more than the 30 values"),
    ("nesting deeper than any shape", [json_input([1, 30], [[[[[[[[[[0.5]]]]]]]]]])], b"", 400, "nested deeper"),
    ("string values", [json_input([1, 30], ["0.5"] * 30)], b"", 400, "not FP32"),
    ("bool values", [json_input([1, 30], [True] * 30)], b"", 400, "not FP32"),
    ("NaN", [json_input([1, 30], [float("nan")] + ROW[1:])], b"", 400, "NaN or infinity (value 0)"),
    ("infinity in row 2", [json_input([2, 30], ROW + [0.5, float("inf")] + ROW[2:])], b"", 400, "(value 31)"),
    ("-infinity", [json_input([1, 30], ROW[:-1] + [float("-inf")])], b"", 400, "NaN or infinity"),
    ("binary size below the shape", [binary_input([1, 30], 8)], b"\0" * 8, 400, "disagrees with shape"),
    ("binary size above the shape", [binary_input([1, 30], 240)], b"\0" * 240, 400, "disagrees with shape"),
    ("binary part shorter", [binary_input([1, 30], 120)], b"\0" * 4, 400, "binary part holds 4 bytes"),
    ("binary part longer", [binary_input([1, 30], 120)], b"\0" * 200, 400, "binary part holds 200 bytes"),
    ("binary size not a number", [binary_input([1, 30], "120")], b"\0" * 120, 400, "binary_data_size '120'"),
    ("both data and binary", [{**binary_input([1, 30], 120), "data": ROW}], b"\0" * 120, 400, "both"),
    ("no data", [{"name": "INPUT__0", "shape": [1, 30], "datatype": "FP32"}], b"", 400, "no 'data'"),
    ("wrong input name", [json_input([1, 30], ROW, name="X")], b"", 400, "unknown input 'X'"),
    ("wrong dtype", [json_input([1, 30], [1] * 30, datatype="INT64")], b"", 400, "is FP32, not INT64"),
    ("unknown dtype", [json_input([1, 30], ROW, datatype="FP128")], b"", 400, "'datatype' must be one of"),
    ("missing dtype", [{"name": "INPUT__0", "shape": [1, 30], "data": ROW}], b"", 400, "'datatype' must be"),
    ("wrong feature count", [json_input([1, 29], ROW[:29])], b"", 400, "does not fit the model's [batch, 30]"),
    ("no batch dimension", [json_input([30], ROW)], b"", 400, "does not fit"),
    ("batch over max_batch_size", [json_input([257, 30], ROW * 257)], b"", 400, "max_batch_size 256"),
    ("input given twice", [json_input([1, 30], ROW), json_input([1, 30], ROW)], b"", 400, "given twice"),
    ("no inputs", [], b"", 400, "'inputs' must be a list"),
    ("input not an object", ["INPUT__0"], b"", 400, "must be an object with a 'name'"),
    ("empty name", [json_input([1, 30], ROW, name="")], b"", 400, "with a 'name'"),
]


@pytest.mark.parametrize(("case", "inputs", "tail", "status", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_hostile_request_is_refused_with_a_clear_4xx(case, inputs, tail, status, words):
    with pytest.raises(RequestRefused) as refused:
        check_request({"inputs": inputs}, tail, MODEL)
    assert refused.value.status == status
    assert words in str(refused.value)


@pytest.mark.parametrize(("datatype", "value", "ok"), [
    ("INT8", 127, True), ("INT8", 128, False), ("UINT8", -1, False), ("INT64", 2**63 - 1, True),
    ("INT64", 2**63, False), ("INT64", 10**30, False), ("UINT64", 2**64 - 1, True), ("INT32", 1.5, False),
    ("BOOL", True, True), ("BOOL", 1, False), ("BYTES", "a", True), ("BYTES", 1, False),
])
def test_values_must_fit_the_datatype_without_a_model_config(datatype, value, ok):
    request = {"inputs": [json_input([1], [value], datatype=datatype, name="X")]}
    if ok:
        check_request(request, b"", None)
    else:
        with pytest.raises(RequestRefused, match="not " + datatype):
            check_request(request, b"", None)


def test_shape_limits_apply_without_a_model_config():
    with pytest.raises(RequestRefused) as refused:
        check_request({"inputs": [json_input([2147483648, 30], ROW)]}, b"", None, Limits(max_input_bytes=1 << 20))
    assert refused.value.status == 413


@pytest.mark.parametrize(("body", "header_length", "words"), [
    (b'{"inputs": [', None, "not valid JSON"),
    (b"", None, "not valid JSON"),
    (b"\xff\xfe", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b"null", None, "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, None, "not valid JSON"),
    (b"{}", "x", "must be a byte count"),
    (b"{}", "-1", "outside the body"),
    (b"{}", "3", "outside the body"),
])
def test_malformed_body_is_a_400(body, header_length, words):
    with pytest.raises(RequestRefused) as refused:
        split_body(body, header_length)
    assert refused.value.status == 400 and words in str(refused.value)


def test_binary_body_splits_at_the_header_length():
    header = json.dumps({"inputs": [binary_input([1, 30], 120)]}).encode()
    request, tail = split_body(header + b"\0" * 120, str(len(header)))
    assert request["inputs"][0]["name"] == "INPUT__0" and len(tail) == 120


@pytest.mark.parametrize(("datatype", "raw", "first_bad"), [
    ("FP32", np.array([0.5, 1.0, 2.0], np.float32).tobytes(), None),
    ("FP32", np.array([0.5, np.nan, np.inf], np.float32).tobytes(), 1),
    ("FP64", np.array([0.5, 1.0, -np.inf], np.float64).tobytes(), 2),
    ("FP16", np.array([np.inf, 1.0], np.float16).tobytes(), 0),
    ("BF16", struct.pack("<3H", 0x3F80, 0x7FC0, 0x3F80), 1),  # 1.0, NaN, 1.0
    ("BF16", struct.pack("<2H", 0x3F80, 0xFF80), 1),  # 1.0, -inf
])
def test_binary_floats_are_checked_for_nan_and_infinity(datatype, raw, first_bad):
    from tritonguard.checks import BinaryInput

    assert first_non_finite(raw, BinaryInput("X", datatype, 0, len(raw))) == first_bad


@pytest.mark.parametrize(("path", "closed"), [
    ("/v2/systemsharedmemory/region/x/register", True),
    ("/v2/cudasharedmemory/status", True),
    ("/v2/models/propensity/generate", True),
    ("/v2/models/propensity/versions/3/generate_stream", True),
    ("/v2/trace/setting", True),
    ("/v2/logging", True),
    ("/v2/models/propensity/infer", False),
    ("/v2/models/propensity/config", False),
    ("/v2/repository/models/propensity/load", False),
    ("/v2/health/ready", False),
])
def test_routes_no_client_of_the_suite_uses_are_closed(path, closed):
    assert bool(CLOSED.fullmatch(path)) is closed


@pytest.mark.parametrize(("path", "model", "version"), [
    ("/v2/models/propensity/infer", "propensity", None),
    ("/v2/models/propensity/versions/12/infer", "propensity", "12"),
])
def test_infer_route_names_model_and_version(path, model, version):
    match = INFER.fullmatch(path)
    assert match and match.group(1) == model and match.group(2) == version
