"""The data quality gate of a features partition: pure checks over its ``_MANIFEST.json``. Stdlib only.

Inputs: the manifest of the new partition (written by ``jobs/build_features.py``), the manifest of the
previous published partition (optional), and the declared contract from ``include/config/features.json``
(schema with types and roles, thresholds; validated the way hybridflow.config validates every config file).
Each check returns :class:`CheckResult` rows; :func:`enforce` raises :class:`~hybridflow.exceptions.DataQualityError`
naming every failed check, its column, observed and expected values, and the runbook.

Manifest keys read: ``ds``, ``row_count``, ``columns`` ([{name, type}]), ``feature_columns``,
``null_ratio`` ({column: ratio}), ``nan_ratio`` ({feature: ratio}), ``label_rate``, ``quarantine``
({rows, ratio, by_reason}).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hybridflow.config import build, check_integer, check_mapping, check_number
from hybridflow.exceptions import ConfigError, DataQualityError
from hybridflow.paths import include_dir

RUNBOOK = "include/runbooks/data-quality.md"
CONTRACT_FILE = "config/features.json"
ROLES = ("key", "label", "feature")
FEATURE_TYPES = ("float32", "float64")  # model inputs
TYPES = ("string", "int8", "int16", "int32", "int64", "float32", "float64", "bool", "date", "timestamp",
         "binary")
REQUIRED_MANIFEST_KEYS = ("ds", "row_count", "columns", "feature_columns", "null_ratio", "quarantine")


class Status(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    type: str
    role: str

    def validate(self, where: str) -> None:
        if self.type not in TYPES:
            raise ConfigError(f"{where}.type: {self.type!r} (column {self.name}); expected one of {', '.join(TYPES)}")
        if self.role not in ROLES:
            raise ConfigError(f"{where}.role: {self.role!r} (column {self.name}); expected one of {', '.join(ROLES)}")
        if self.role == "feature" and self.type not in FEATURE_TYPES:
            raise ConfigError(f"{where}.type: {self.type!r} (column {self.name}); a feature (a model input) is "
                              f"{' or '.join(FEATURE_TYPES)}")


@dataclass(frozen=True)
class Thresholds:
    min_rows: int = 1
    min_row_ratio: float = 0.5
    max_row_ratio: float = 2.0
    max_null_ratio: float = 0.0
    max_null_ratio_per_column: Mapping[str, float] = field(default_factory=dict)
    max_nan_ratio: float = 0.0
    max_quarantine_ratio: float = 0.05
    min_label_rate: float | None = None
    max_label_rate: float | None = None

    def null_limit(self, column: str) -> float:
        return self.max_null_ratio_per_column.get(column, self.max_null_ratio)

    def validate(self, where: str) -> None:
        if self.min_row_ratio > self.max_row_ratio:
            raise ConfigError(f"{where}.row_count_change.min_ratio: {self.min_row_ratio:g}; expected at most "
                              f"max_ratio ({self.max_row_ratio:g})")


@dataclass(frozen=True)
class FeatureContract:
    columns: tuple[ColumnSpec, ...]
    thresholds: Thresholds
    source: str = "<memory>"

    @property
    def feature_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.role == "feature")

    @property
    def types(self) -> dict[str, str]:
        return {c.name: c.type for c in self.columns}

    def validate(self) -> None:
        """What no one column or threshold shows: each column listed once, a model input, per-column limits only
        for declared columns."""
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"schema: {', '.join(duplicates)} more than once; list each column once")
        if not self.feature_columns:
            raise ConfigError("schema: no column with role 'feature'; declare the model inputs")
        unknown = sorted(set(self.thresholds.max_null_ratio_per_column) - set(names))
        if unknown:
            raise ConfigError(f"thresholds.max_null_ratio.per_column: {', '.join(unknown)}; name only columns "
                              "the schema declares")


@dataclass(frozen=True)
class CheckResult:
    check: str
    column: str | None
    status: Status
    observed: Any
    expected: str

    @property
    def failed(self) -> bool:
        return self.status is Status.FAILED

    def describe(self) -> str:
        where = f" column={self.column}" if self.column else ""
        return f"{self.check}{where}: observed {_show(self.observed)}, expected {self.expected}"

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "column": self.column, "status": self.status.value,
                "observed": self.observed, "expected": self.expected}


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def parse_contract(data: Mapping[str, Any], source: str = "<memory>") -> FeatureContract:
    """The declared features contract; ConfigError names the file, the key, the value and what to do (the style of
    hybridflow.config). Keys other than ``schema`` and ``thresholds`` are left to their readers."""
    try:
        schema = data.get("schema")
        if not isinstance(schema, list) or not schema:
            raise ConfigError(f"schema: {schema!r}; expected a non-empty list of {{name, type, role}}")
        columns = tuple(build(ColumnSpec, entry, f"schema[{i}]") for i, entry in enumerate(schema))
        contract = FeatureContract(columns, parse_thresholds(data.get("thresholds", {})), source)
        contract.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return contract


def parse_thresholds(raw: Any, where: str = "thresholds") -> Thresholds:
    """The ``thresholds`` object; a key it leaves out keeps the :class:`Thresholds` default."""
    raw = check_mapping(raw, where)
    change = check_mapping(raw.get("row_count_change", {}), f"{where}.row_count_change")
    nulls = check_mapping(raw.get("max_null_ratio", {}), f"{where}.max_null_ratio")
    per_column = check_mapping(nulls.get("per_column", {}), f"{where}.max_null_ratio.per_column")
    label = check_mapping(raw.get("label_rate", {}), f"{where}.label_rate")

    def ratio(value: Any, key: str) -> float:
        return check_number(value, f"{where}.{key}", minimum=0, finite=False)

    thresholds = Thresholds(
        min_rows=check_integer(raw.get("min_rows", Thresholds.min_rows), f"{where}.min_rows", 0),
        min_row_ratio=ratio(change.get("min_ratio", Thresholds.min_row_ratio), "row_count_change.min_ratio"),
        max_row_ratio=ratio(change.get("max_ratio", Thresholds.max_row_ratio), "row_count_change.max_ratio"),
        max_null_ratio=ratio(nulls.get("default", Thresholds.max_null_ratio), "max_null_ratio.default"),
        max_null_ratio_per_column={column: ratio(value, f"max_null_ratio.per_column.{column}")
                                   for column, value in per_column.items()},
        max_nan_ratio=ratio(raw.get("max_nan_ratio", Thresholds.max_nan_ratio), "max_nan_ratio"),
        max_quarantine_ratio=ratio(raw.get("max_quarantine_ratio", Thresholds.max_quarantine_ratio),
                                   "max_quarantine_ratio"),
        min_label_rate=None if label.get("min") is None else ratio(label["min"], "label_rate.min"),
        max_label_rate=None if label.get("max") is None else ratio(label["max"], "label_rate.max"),
    )
    thresholds.validate(where)
    return thresholds


def load_contract(path: str | Path | None = None) -> FeatureContract:
    """Reads the contract file (default ``include/config/features.json``)."""
    path = Path(path) if path is not None else include_dir() / CONTRACT_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: the features contract file does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    return parse_contract(data, str(path))


def _result(check: str, column: str | None, ok: bool, observed: Any, expected: str) -> CheckResult:
    return CheckResult(check, column, Status.PASSED if ok else Status.FAILED, observed, expected)


def check_manifest_keys(manifest: Mapping[str, Any]) -> list[CheckResult]:
    return [_result("manifest", key, key in manifest, "present" if key in manifest else "absent", "present")
            for key in REQUIRED_MANIFEST_KEYS]


def check_schema(manifest: Mapping[str, Any], contract: FeatureContract) -> list[CheckResult]:
    """Every declared column present with its type, no undeclared column, feature order as declared."""
    observed = {c["name"]: c["type"] for c in manifest.get("columns", [])}
    results = []
    for spec in contract.columns:
        if spec.name not in observed:
            results.append(_result("schema.missing_column", spec.name, False, "absent", spec.type))
        else:
            results.append(_result("schema.type", spec.name, observed[spec.name] == spec.type,
                                   observed[spec.name], spec.type))
    declared = contract.types
    for name, type_ in observed.items():
        if name not in declared:
            results.append(_result("schema.unexpected_column", name, False, type_,
                                   "not in the declared schema"))
    got_order = list(manifest.get("feature_columns", []))
    want_order = list(contract.feature_columns)
    if got_order == want_order:
        results.append(_result("schema.feature_order", None, True, f"{len(got_order)} columns",
                               "declared order"))
    else:
        first = next((i for i, (a, b) in enumerate(zip(got_order, want_order, strict=False)) if a != b),
                     min(len(got_order), len(want_order)))
        got = got_order[first] if first < len(got_order) else "<end>"
        want = want_order[first] if first < len(want_order) else "<end>"
        results.append(_result("schema.feature_order", got, False,
                               f"feature_columns[{first}]={got} ({len(got_order)} features)",
                               f"feature_columns[{first}]={want} ({len(want_order)} features)"))
    return results


def check_row_count(manifest: Mapping[str, Any], previous: Mapping[str, Any] | None,
                    contract: FeatureContract) -> list[CheckResult]:
    """At least ``min_rows``; within [min_ratio, max_ratio] of the previous partition when there is one."""
    limits = contract.thresholds
    rows = manifest.get("row_count")
    results = [_result("row_count.min", None, isinstance(rows, int) and rows >= limits.min_rows, rows,
                       f">= {limits.min_rows}")]
    if previous is None or not previous.get("row_count"):
        results.append(CheckResult("row_count.change", None, Status.SKIPPED, rows, "no previous partition"))
        return results
    before = previous["row_count"]
    ratio = rows / before if isinstance(rows, int) else float("nan")
    results.append(_result(
        "row_count.change", None, limits.min_row_ratio <= ratio <= limits.max_row_ratio,
        f"{rows} rows = {ratio:.3g} x previous",
        f"within [{limits.min_row_ratio:g}, {limits.max_row_ratio:g}] x {before} rows "
        f"(ds={previous.get('ds')})",
    ))
    return results


def check_null_ratios(manifest: Mapping[str, Any], contract: FeatureContract) -> list[CheckResult]:
    """Null ratio per declared column, and NaN ratio per feature, under their limits."""
    limits = contract.thresholds
    nulls = manifest.get("null_ratio", {})
    nans = manifest.get("nan_ratio", {})
    present = {c["name"] for c in manifest.get("columns", [])}
    results = []
    for spec in contract.columns:
        limit = limits.null_limit(spec.name)
        value = nulls.get(spec.name)
        if value is None and spec.name not in present:
            results.append(CheckResult("null_ratio", spec.name, Status.SKIPPED, "column absent",
                                       "see schema.missing_column"))
            continue
        results.append(_result("null_ratio", spec.name, value is not None and value <= limit,
                               "not reported" if value is None else value, f"<= {limit:g}"))
    for name in contract.feature_columns:
        if name in nans:
            results.append(_result("nan_ratio", name, nans[name] <= limits.max_nan_ratio, nans[name],
                                   f"<= {limits.max_nan_ratio:g}"))
    return results


def check_quarantine_ratio(manifest: Mapping[str, Any], contract: FeatureContract) -> list[CheckResult]:
    limit = contract.thresholds.max_quarantine_ratio
    section = manifest.get("quarantine", {})
    ratio = section.get("ratio")
    if ratio is None:
        return [_result("quarantine_ratio", None, False, "not reported", f"<= {limit:g}")]
    worst = max(section.get("by_reason", {}).items(), key=lambda kv: kv[1], default=(None, 0))
    most = f", most: {worst[0]}={worst[1]}" if worst[1] else ""
    observed = f"{ratio:.6g} ({section.get('rows')} rows{most})"
    return [_result("quarantine_ratio", None, ratio <= limit, observed, f"<= {limit:g}")]


def check_label_rate(manifest: Mapping[str, Any], contract: FeatureContract) -> list[CheckResult]:
    low, high = contract.thresholds.min_label_rate, contract.thresholds.max_label_rate
    if low is None and high is None:
        return []
    rate = manifest.get("label_rate")
    expected = f"within [{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
    ok = rate is not None and (low is None or rate >= low) and (high is None or rate <= high)
    return [_result("label_rate", "label", ok, "not reported" if rate is None else rate, expected)]


def run_checks(manifest: Mapping[str, Any], previous: Mapping[str, Any] | None,
               contract: FeatureContract) -> list[CheckResult]:
    """Every check of the gate, in a stable order."""
    keys = check_manifest_keys(manifest)
    if any(r.failed for r in keys):
        return keys
    return [
        *keys,
        *check_schema(manifest, contract),
        *check_row_count(manifest, previous, contract),
        *check_null_ratios(manifest, contract),
        *check_quarantine_ratio(manifest, contract),
        *check_label_rate(manifest, contract),
    ]


def failure_message(results: Sequence[CheckResult], ds: str | None = None, limit: int = 20) -> str:
    failed = [r for r in results if r.failed]
    head = f"data quality gate failed for features ds={ds}" if ds else "data quality gate failed"
    lines = [f"{head}: {len(failed)} of {len(results)} checks failed"]
    lines += [f"  - {r.describe()}" for r in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"  - ... and {len(failed) - limit} more (see the task's check results)")
    lines.append(f"Runbook: {RUNBOOK}")
    return "\n".join(lines)


def enforce(results: Sequence[CheckResult], ds: str | None = None) -> list[CheckResult]:
    """Returns the results when none failed; otherwise raises DataQualityError naming every failure."""
    if any(r.failed for r in results):
        raise DataQualityError(failure_message(results, ds), results=tuple(results))
    return list(results)


def gate(manifest: Mapping[str, Any], previous: Mapping[str, Any] | None,
         contract: FeatureContract) -> list[CheckResult]:
    """run_checks + enforce: the whole gate in one call."""
    return enforce(run_checks(manifest, previous, contract), manifest.get("ds"))


def require_published(manifest: Mapping[str, Any] | None, partition: str) -> Mapping[str, Any]:
    """The manifest of a published partition (hooks/storage_root.py reads it); an unpublished one fails the gate."""
    if manifest is None:
        result = _result("published", None, False, f"no _SUCCESS in {partition}",
                         "_SUCCESS written by the job")
        raise DataQualityError(failure_message([result]), results=(result,))
    return manifest


def previous_ds(published: Iterable[str], ds: str) -> str | None:
    """The latest published ds strictly before ``ds`` (ISO dates sort as strings)."""
    earlier = [d for d in published if d < ds]
    return max(earlier) if earlier else None


def summary(results: Sequence[CheckResult]) -> dict[str, Any]:
    """JSON-able counts and the failures, for XCom or a run report."""
    return {
        "passed": sum(r.status is Status.PASSED for r in results),
        "failed": sum(r.status is Status.FAILED for r in results),
        "skipped": sum(r.status is Status.SKIPPED for r in results),
        "failures": [r.as_dict() for r in results if r.failed],
    }
