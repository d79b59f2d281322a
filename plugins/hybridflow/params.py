"""Param schemas that refuse bad values when a run is triggered, not minutes later in a task.

Airflow checks a trigger's conf against each param's JSON schema in the api-server (jsonschema; no code of ours
runs there) and answers 400 naming the param. Whatever a schema lets through reaches the tasks, so the schemas
built here close the gaps JSON Schema leaves open by default:

- a pattern matches the whole value: jsonschema uses ``re.search``, whose ``$`` also matches before a final
  newline. :func:`anchored` writes ``^(?:...)$(?!\\n)``, which means the same to Python's ``re`` and to the
  JavaScript ``RegExp`` of the UI's form (``\\Z`` is not JavaScript);
- every number has a minimum and a maximum: a 30-digit int kills the task runner (``OverflowError: can't
  serialize ints``) and ``1e400`` arrives as infinity. NaN passes every comparison, so :func:`number` also
  refuses it explicitly;
- draft-04 semantics (:data:`DRAFT4`): its ``integer`` is an int only, where drafts 6+ take 1.0 and 1e2;
- objects list their fields, each typed, and refuse any other.

:func:`strict_params` applies the draft and refuses, when the DAG is parsed, a param schema missing one of these,
so every DAG gets them. Pure: no Airflow import at module level.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hybridflow.utils.stalls import STALL_SETTINGS

if TYPE_CHECKING:
    from airflow.sdk import Param

    from hybridflow.config import RecoveryConfig

__all__ = ["DRAFT4", "MAX_VERSION", "NOT_NAN", "anchored", "closed_object", "date", "field_union", "integer",
           "is_anchored", "model_version", "number", "schema_problems", "stall_watch", "strict_params", "text",
           "workload_config"]

DRAFT4 = "http://json-schema.org/draft-04/schema#"
END = r"$(?!\n)"
# Only NaN is both >= 1 and <= -1 (every comparison with it is false), so `not` of this refuses NaN alone.
NOT_NAN = {"not": {"title": "NaN (not a number)", "type": "number", "minimum": 1, "maximum": -1}}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
MAX_VERSION = 2**31 - 1  # far above any real model version, far below the 64-bit ints the task runner can carry


def _strip_end_anchor(body: str) -> str:
    """``body`` without a final ``$`` that is an anchor (not ``\\$``, an escaped dollar)."""
    if not body.endswith("$"):
        return body
    backslashes = len(body[:-1]) - len(body[:-1].rstrip("\\"))
    return body[:-1] if backslashes % 2 == 0 else body


def anchored(pattern: str) -> str:
    """``pattern`` as a full match with the same meaning in Python ``re.search`` and JavaScript ``RegExp``.

    A leading ``^`` and a final ``$`` are dropped first, so a pattern written ``^...$`` can be reused.
    """
    if is_anchored(pattern):
        return pattern
    body = _strip_end_anchor(pattern.removeprefix("^"))
    return f"^(?:{body}){END}"


def _group_end(pattern: str, start: int) -> int:
    """Index of the ``)`` closing the group opened at ``start`` (escapes and character classes skipped)."""
    depth, i, in_class = 0, start, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":  # a class ends at its first unescaped ], as in JavaScript (write a literal ] as \\])
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def is_anchored(pattern: Any) -> bool:
    """Written by :func:`anchored`: one group between ``^`` and ``$(?!\\n)`` (``^(?:a)|(?:b)$`` is not)."""
    return (isinstance(pattern, str) and pattern.startswith("^(?:") and pattern.endswith(")" + END)
            and _group_end(pattern, 1) == len(pattern) - len(END) - 1)


def integer(minimum: int, maximum: int, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum, **extra}


def number(minimum: float, maximum: float, **extra: Any) -> dict[str, Any]:
    """A finite number in [minimum, maximum]: the bounds refuse +-inf, :data:`NOT_NAN` refuses NaN."""
    return {"type": "number", "minimum": minimum, "maximum": maximum, **NOT_NAN, **extra}


def model_version(minimum: int, **extra: Any) -> dict[str, Any]:
    """A model version number (Triton's numbering; 0 where the DAG reads it as "the one before")."""
    return integer(minimum, MAX_VERSION, **extra)


def text(pattern: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "pattern": anchored(pattern), **extra}


def date(**extra: Any) -> dict[str, Any]:
    """YYYY-MM-DD that is a real day (jsonschema's ``date`` format; the api-server checks formats)."""
    return text(DATE, format="date", **extra)


def closed_object(properties: Mapping[str, Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {k: dict(v) for k, v in properties.items()},
            "additionalProperties": False, **extra}


def field_union(schemas: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One property schema per field name from ``(name, schema)`` pairs of several sources (e.g. workload types):
    one schema when they agree (descriptions aside), else ``anyOf`` of the distinct ones."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    descriptions: dict[str, list[str]] = {}
    for name, schema in schemas:
        rule = {k: v for k, v in schema.items() if k != "description"}
        found.setdefault(name, {})[json.dumps(rule, sort_keys=True)] = rule
        description = schema.get("description")
        if description and description not in descriptions.setdefault(name, []):
            descriptions[name].append(description)
    union = {}
    for name, distinct in found.items():
        rules = list(distinct.values())
        union[name] = dict(rules[0]) if len(rules) == 1 else {"anyOf": rules}
        if descriptions.get(name):
            union[name]["description"] = "; ".join(descriptions[name])
    return union


def workload_config(workloads: Iterable[Any]) -> dict[str, Any]:
    """The ``config`` object of the workload router: every field some workload type of routing.yaml accepts
    (``hybridflow.pipeline.routing.WorkloadRules``), typed as its rule says. Which type takes which field is checked
    by the route task (a param's schema cannot see the other params)."""
    def schema(rule: Any) -> dict[str, Any]:
        if rule.type == "integer":
            return integer(rule.minimum, rule.maximum, description=rule.description)
        if rule.type == "date":
            return date(description=rule.description)
        if rule.type == "string":
            return text(rule.pattern, description=rule.description)
        raise ValueError(f"config field {rule.name}: no schema for type {rule.type!r}")

    return closed_object(field_union((name, schema(rule)) for workload in workloads
                                     for name, rule in workload.fields.items()))


_STALL_DESCRIPTIONS = {
    "stall_timeout_s": "Stall watch: the longest a rank may go without progress, in any phase (start-up, data load, "
                       "checkpoints, evaluation); the job's collective timeout is this + 180 s.",
    "stall_floor_s": "Stall watch: the shortest progress deadline of a training rank past its warm-up.",
    "stall_factor": "Stall watch: a training rank's deadline is this many times its median step time (at least "
                    "stall_floor_s, at most stall_timeout_s).",
    "stall_warm_up_steps": "Stall watch: the steps a rank trains (after each start or resume) before its deadline "
                           "follows its own step time.",
}


def stall_watch(recovery: RecoveryConfig) -> dict[str, Param]:
    """The stall watch's settings as a run's params: pipeline.yaml's values by default, bounded as pipeline.yaml's
    are (:data:`hybridflow.utils.stalls.STALL_SETTINGS`)."""
    from airflow.sdk import Param

    params = {}
    for name, (low, high) in STALL_SETTINGS.items():
        schema = integer(int(low), int(high)) if name == "stall_warm_up_steps" else number(low, high)
        params[name] = Param(getattr(recovery, name), **schema, description=_STALL_DESCRIPTIONS[name])
    return params


# --- the policy every DAG param follows -----------------------------------------------------------------------

def _bounded(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and abs(value) < float("inf")


def schema_problems(schema: Any, where: str) -> list[str]:
    """What in a param's JSON schema lets a bad value through to the tasks; empty when nothing does."""
    if not isinstance(schema, Mapping):
        return [f"{where}: not a schema"]
    problems = []
    if "pattern" in schema and not is_anchored(schema["pattern"]):
        problems.append(f"{where}: pattern {schema['pattern']!r} is not full-match; use anchored()")
    for key in ("anyOf", "oneOf"):
        for i, branch in enumerate(schema.get(key, ())):
            problems += schema_problems(branch, f"{where}.{key}[{i}]")
    if "anyOf" in schema or "oneOf" in schema:
        return problems
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not kinds:
        problems.append(f"{where}: no type")
    for kind in kinds:
        if kind in ("integer", "number"):
            if not (_bounded(schema.get("minimum")) and _bounded(schema.get("maximum"))):
                problems.append(f"{where}: a {kind} needs a finite minimum and maximum")
            if kind == "number" and schema.get("not") != NOT_NAN["not"]:
                problems.append(f"{where}: a number must refuse NaN; use number()")
        elif kind == "string":  # free text is fine when bounded; a token needs an enum or a pattern
            if "enum" not in schema and "pattern" not in schema and not _bounded(schema.get("maxLength")):
                problems.append(f"{where}: a string needs an enum, a full-match pattern or a maxLength")
        elif kind == "object":
            if schema.get("additionalProperties") is not False or not isinstance(schema.get("properties"), Mapping):
                problems.append(f"{where}: an object must list its fields; use closed_object()")
            for name, sub in (schema.get("properties") or {}).items():
                problems += schema_problems(sub, f"{where}.{name}")
        elif kind == "array":
            if not _bounded(schema.get("maxItems")) or "items" not in schema:
                problems.append(f"{where}: an array needs items and maxItems")
            else:
                problems += schema_problems(schema["items"], f"{where}[]")
        elif kind not in ("boolean", "null"):
            problems.append(f"{where}: unknown type {kind!r}")
    return problems


def strict_params(params: Mapping[str, Param]) -> dict[str, Param]:
    """The DAG's params under draft-04 (ints are ints), after checking each against :func:`schema_problems`.

    :raises ValueError: listing every param schema that would let a bad value through (an import error of the
        DAG, so it cannot ship).
    """
    from airflow.sdk import Param

    problems = [p for name, param in params.items() for p in schema_problems(param.schema, name)]
    if problems:
        raise ValueError("param schemas let bad values through: " + "; ".join(problems))
    strict = {}
    for name, param in params.items():
        strict[name] = Param(param.value, description=param.description,
                             schema={"$schema": DRAFT4, **param.schema})
        if param.has_value:
            strict[name].resolve()  # the default must pass its own schema under draft-04 too
    return strict
