"""Param schemas (hybridflow.params) by tables: each class of bad value per kind of param is refused by the
api-server's own check, good values pass; patterns mean the same in Python and JavaScript; the policy check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from airflow.exceptions import ParamValidationError
from airflow.sdk import Param
from airflow.serialization.definitions.param import SerializedParam, SerializedParamsDict
from hybridflow.config import RecoveryConfig, load_pipeline_config
from hybridflow.params import (
    DRAFT4,
    anchored,
    closed_object,
    date,
    integer,
    number,
    schema_problems,
    stall_watch,
    strict_params,
    text,
    workload_config,
)
from hybridflow.pipeline.routing import load_routing_rules
from hybridflow.utils.stalls import STALL_SETTINGS

ROUTER_CONFIG = workload_config(load_routing_rules().workloads.values())
KINDS = {
    "integer": integer(1, 8),
    "number": number(0, 1e12),
    "signed": number(-10, 10),
    "pattern": text(r"[A-Za-z0-9_-]{1,64}"),
    "date": date(),
    "object": closed_object({"rows": integer(1000, 10**7), "ds": date(), "speed": number(0, 1e6)}),
    "router_config": ROUTER_CONFIG,
}
HUGE = "1" + "0" * 29  # 30 digits: past the 64-bit ints the task runner can serialize


def trigger(kind: str, raw: str) -> None:
    """What the api-server does with a trigger's conf: the JSON parsed by Python's json (NaN, Infinity and 1e400
    included), merged into the DAG's params and validated (SerializedParamsDict, the server's own class)."""
    params = SerializedParamsDict({"p": SerializedParam(**{"$schema": DRAFT4, **KINDS[kind]})})
    params.deep_merge({"p": json.loads(raw)}).validate()


# (kind, conf value as a client sends it, accepted)
VALUES = [
    ("integer", "1", True), ("integer", "8", True),
    ("integer", "1.0", False), ("integer", "1e2", False), ("integer", "2.5", False),
    ("integer", "0", False), ("integer", "9", False), ("integer", HUGE, False), ("integer", "-" + HUGE, False),
    ("integer", "NaN", False), ("integer", "Infinity", False), ("integer", "-Infinity", False),
    ("integer", "1e400", False), ("integer", "true", False), ('integer', '"1"', False), ("integer", "null", False),
    ("integer", "[1]", False),
    ("number", "0", True), ("number", "2.5", True), ("number", "1e12", True), ("number", "7", True),
    ("number", "1e400", False), ("number", "-1e400", False), ("number", "NaN", False),
    ("number", "Infinity", False), ("number", "-Infinity", False), ("number", "-0.1", False),
    ("number", "1e13", False), ("number", HUGE, False), ("number", "true", False), ('number', '"5"', False),
    ("signed", "-10", True), ("signed", "-0.5", True), ("signed", "0", True), ("signed", "1", True),
    ("signed", "-1", True), ("signed", "NaN", False), ("signed", "-Infinity", False),
    ("pattern", '"gpu-training"', True), ("pattern", '"a"', True), ("pattern", json.dumps("a" * 64), True),
    ("pattern", '"gpu-training\\n"', False), ("pattern", '"\\ngpu"', False), ("pattern", '" gpu"', False),
    ("pattern", '"gpu "', False), ("pattern", '"gpu\\r"', False), ("pattern", '"gpu\\u2028"', False),
    ("pattern", '""', False), ("pattern", json.dumps("a" * 65), False), ("pattern", '"gpu;id"', False),
    ("pattern", "5", False), ("pattern", "null", False),
    ("date", '"2026-01-01"', True), ("date", '"2024-02-29"', True),
    ("date", '"2026-02-30"', False), ("date", '"2026-01-01\\n"', False), ("date", '" 2026-01-01"', False),
    ("date", '"20260101"', False), ("date", '"2026-1-1"', False), ("date", '"2026-W01-1"', False),
    ("object", "{}", True), ("object", '{"rows": 1000, "ds": "2026-01-01", "speed": 1.5}', True),
    ("object", '{"bogus": 1}', False), ("object", f'{{"rows": {HUGE}}}', False), ("object", '{"rows": 1000.0}', False),
    ("object", '{"speed": NaN}', False), ("object", '{"speed": 1e400}', False),
    ("object", '{"ds": "2026-01-01\\n"}', False), ("object", "[]", False), ("object", '"x"', False),
    ("object", "null", False),
    ("router_config", "{}", True), ("router_config", '{"hidden_sizes": "128,64", "batch": 65536}', True),
    ("router_config", '{"ds": "2026-01-01", "lookback_days": 90, "rows": 10000000}', True),
    ("router_config", '{"hidden_sizes": "128,64\\n"}', False), ("router_config", '{"hidden_sizes": " 128"}', False),
    ("router_config", '{"batch": 65537}', False), ("router_config", '{"lookback_days": 1.0}', False),
    ("router_config", f'{{"rows": {HUGE}}}', False), ("router_config", '{"rows": 1e5}', False),
    ("router_config", '{"batch": NaN}', False), ("router_config", '{"cmd": "id"}', False),
    ("router_config", '{"ds": ["2026-01-01"]}', False),
]


@pytest.mark.parametrize(("kind", "raw", "accepted"), VALUES, ids=[f"{k}-{r[:24]}" for k, r, _ in VALUES])
def test_trigger_value_is_refused_or_accepted_by_the_servers_check(kind, raw, accepted):
    if accepted:
        trigger(kind, raw)
    else:
        with pytest.raises(ParamValidationError, match="Invalid input for param p"):
            trigger(kind, raw)


@pytest.mark.parametrize(("pattern", "expected"), [
    ("abc", r"^(?:abc)$(?!\n)"),
    ("^abc$", r"^(?:abc)$(?!\n)"),
    ("a|b", r"^(?:a|b)$(?!\n)"),
    (r"price\$", r"^(?:price\$)$(?!\n)"),       # an escaped dollar stays
    (r"a\\$", r"^(?:a\\)$(?!\n)"),              # an escaped backslash, then the anchor
    (r"^(?:abc)$(?!\n)", r"^(?:abc)$(?!\n)"),   # already anchored: unchanged
])
def test_anchored_wraps_the_pattern_as_a_full_match(pattern, expected):
    assert anchored(pattern) == expected


@pytest.mark.parametrize(("pattern", "value", "matches"), [
    ("a|b", "a", True), ("a|b", "ab", False), ("a|b", "xb", False),
    ("[0-9]+", "42", True), ("[0-9]+", "42\n", False), ("[0-9]+", "\n42", False), ("[0-9]+", "4\n2", False),
    (r"price\$", "price$", True), (r"price\$", "price", False),
])
def test_anchored_pattern_matches_only_whole_values(pattern, value, matches):
    assert bool(re.search(anchored(pattern), value)) is matches  # re.search: what jsonschema uses


JS_PATTERNS = [r"^[a-z]+$", anchored("[a-z]+"), anchored(r"[A-Za-z0-9_-]{1,64}"),
               anchored(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"), anchored(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
               anchored(r"[^\x00-\x20\x7f]([^\x00-\x1f\x7f]*[^\x00-\x20\x7f])?")]
JS_SAMPLES = ["abc", "abc\n", "\nabc", "ab\nc", " abc", "abc ", "", "\n", "abc\r", "abc\r\n", "a\u2028", "ab-c_9",
              "2026-01-01", "2026-01-01\n", "x y", "x\ty", "é"]


def test_anchored_patterns_mean_the_same_in_javascript():
    """The UI's editor checks patterns with ``new RegExp(pattern, "u")``: same verdicts as Python's re.search."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = ("const [ps, ss] = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "console.log(JSON.stringify(ps.map(p => ss.map(s => new RegExp(p, 'u').test(s)))));")
    out = subprocess.run([node, "-e", script], input=json.dumps([JS_PATTERNS, JS_SAMPLES]), capture_output=True,
                         text=True, timeout=60, check=True)
    js = json.loads(out.stdout)
    python = [[bool(re.search(p, s)) for s in JS_SAMPLES] for p in JS_PATTERNS]
    # A bare ^...$ is the bug: Python's $ also matches before a final newline, JavaScript's does not.
    assert python[0] != js[0]
    assert python[1:] == js[1:]


@pytest.mark.parametrize(("schema", "problem"), [
    (integer(1, 8), None),
    (number(0, 1), None),
    (text("a"), None),
    ({"type": "string", "enum": ["a"]}, None),
    ({"type": "boolean"}, None),
    ({"type": ["null", "integer"], "minimum": 0, "maximum": 1}, None),
    (closed_object({"a": integer(0, 1), "b": date()}), None),
    ({"type": "array", "items": integer(0, 1), "maxItems": 4}, None),
    ({"type": "integer", "minimum": 0}, "p: a integer needs a finite minimum and maximum"),
    ({"type": "integer", "minimum": 0, "maximum": float("inf")}, "p: a integer needs a finite minimum and maximum"),
    ({"type": "number", "minimum": 0, "maximum": True}, "p: a number needs a finite minimum and maximum"),
    ({"type": "number", "minimum": 0, "maximum": 1}, "p: a number must refuse NaN"),
    ({"type": "string", "maxLength": 500}, None),
    ({"type": "string"}, "p: a string needs an enum, a full-match pattern or a maxLength"),
    ({"type": "string", "pattern": "^a$"}, "p: pattern '^a$' is not full-match"),
    ({"type": "string", "pattern": r"^(?:a)|(?:b)$(?!\n)"}, "p: pattern '^(?:a)|(?:b)$"),
    ({"type": "string", "pattern": r"^(?:[)(]\)(?:x))$(?!\n)"}, None),
    ({"type": "object"}, "p: an object must list its fields"),
    ({"type": "object", "properties": {}, "additionalProperties": True}, "p: an object must list its fields"),
    (closed_object({"a": {"type": "integer"}}), "p.a: a integer needs a finite minimum and maximum"),
    ({"anyOf": [integer(0, 1), {"type": "number"}]}, "p.anyOf[1]: a number needs"),
    ({"type": "array", "items": integer(0, 1)}, "p: an array needs items and maxItems"),
    ({}, "p: no type"),
    ({"type": "any"}, "p: unknown type 'any'"),
])
def test_schema_problems_names_what_lets_a_bad_value_through(schema, problem):
    found = schema_problems(schema, "p")
    if problem is None:
        assert found == []
    else:
        assert any(p.startswith(problem) for p in found), found


def test_strict_params_uses_draft4_and_keeps_values_and_descriptions():
    strict = strict_params({"n": Param(2, **integer(1, 8), description="nodes"),
                            "id": Param(**text("[0-9]+"), description="no default")})
    assert strict["n"].schema == {"$schema": DRAFT4, **integer(1, 8)}
    assert (strict["n"].value, strict["n"].description) == (2, "nodes")
    assert not strict["id"].has_value
    with pytest.raises(ParamValidationError):
        strict["n"].resolve(2.0)  # the task side refuses a float for an int too


@pytest.mark.parametrize(("params", "error"), [
    ({"v": Param(0, type="integer", minimum=0)}, "v: a integer needs a finite minimum and maximum"),
    ({"c": Param({}, type="object")}, "c: an object must list its fields"),
    ({"s": Param("x", type="string", pattern="^x$")}, "s: pattern '^x$' is not full-match"),
])
def test_strict_params_refuses_a_schema_that_lets_bad_values_through(params, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        strict_params(params)


def test_strict_params_refuses_a_default_that_fails_under_draft4():
    with pytest.raises(ParamValidationError):
        strict_params({"gpus": Param(1.0, **integer(1, 8))})


def rule(name: str, kind: str, description: str, **limits) -> SimpleNamespace:
    return SimpleNamespace(name=name, type=kind, description=description, pattern=limits.pop("pattern", None),
                           minimum=limits.get("minimum"), maximum=limits.get("maximum"))


def test_workload_config_types_every_field_and_merges_workload_types():
    workloads = [SimpleNamespace(fields={"ds": rule("ds", "date", "day to build"),
                                         "n": rule("n", "integer", "rows", minimum=1, maximum=9)}),
                 SimpleNamespace(fields={"ds": rule("ds", "date", "day to score"),
                                         "n": rule("n", "string", "name", pattern="[a-z]+")})]
    schema = workload_config(workloads)
    assert schema["additionalProperties"] is False and set(schema["properties"]) == {"ds", "n"}
    assert schema["properties"]["ds"] == date(description="day to build; day to score")
    assert schema["properties"]["n"] == {"anyOf": [integer(1, 9), text("[a-z]+")], "description": "rows; name"}
    assert schema_problems(schema, "config") == []


def test_router_config_lists_every_field_of_routing_yaml():
    fields = {name for w in load_routing_rules().workloads.values() for name in w.fields}
    assert set(ROUTER_CONFIG["properties"]) == fields
    assert schema_problems(ROUTER_CONFIG, "config") == []


STALL = strict_params(stall_watch(RecoveryConfig()))
# Each class of bad value, as a client sends it, for every stall param (the integer one refuses fractions too).
STALL_BAD = ["NaN", "Infinity", "-Infinity", "1e400", HUGE, "-" + HUGE, "true", "null", '"30"', "[30]", "{}", "-1",
             "0", "1e9"]
STALL_VALUES = [(name, raw, False) for name in STALL for raw in STALL_BAD]
STALL_VALUES += [("stall_timeout_s", "9.5", False), ("stall_timeout_s", "86401", False),
                 ("stall_floor_s", "9", False), ("stall_floor_s", "3601", False),
                 ("stall_factor", "1.5", False), ("stall_factor", "1000.5", False),
                 ("stall_warm_up_steps", "2.5", False), ("stall_warm_up_steps", "5.0", False),
                 ("stall_warm_up_steps", "1e2", False), ("stall_warm_up_steps", "10001", False)]
STALL_VALUES += [("stall_timeout_s", "10", True), ("stall_timeout_s", "86400", True),
                 ("stall_timeout_s", "600.5", True), ("stall_floor_s", "10", True), ("stall_floor_s", "3600", True),
                 ("stall_factor", "2", True), ("stall_factor", "12.5", True), ("stall_warm_up_steps", "1", True),
                 ("stall_warm_up_steps", "10000", True)]


@pytest.mark.parametrize(("name", "raw", "accepted"), STALL_VALUES, ids=[f"{n}-{r[:24]}" for n, r, _ in STALL_VALUES])
def test_a_runs_stall_settings_are_refused_or_accepted_by_the_servers_check(name, raw, accepted):
    """The nightly run's stall params (hybridflow.params.stall_watch) take pipeline.yaml's bounds."""
    params = SerializedParamsDict({name: SerializedParam(**STALL[name].schema, default=STALL[name].value)})
    merged = params.deep_merge({name: json.loads(raw)})
    if accepted:
        merged.validate()
    else:
        with pytest.raises(ParamValidationError, match=f"Invalid input for param {name}"):
            merged.validate()


def test_a_runs_stall_settings_default_to_the_pipeline_config_and_stay_within_its_bounds():
    config = load_pipeline_config()
    params = stall_watch(config.recovery)
    assert {name: param.value for name, param in params.items()} == {
        name: getattr(config.recovery, name) for name in STALL_SETTINGS}
    for name, (low, high) in STALL_SETTINGS.items():
        assert (params[name].schema["minimum"], params[name].schema["maximum"]) == (low, high)
        assert params[name].description.startswith("Stall watch: ")
