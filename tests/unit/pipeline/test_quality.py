"""Tables for the data quality gate (hybridflow.pipeline.quality): contract parsing, each check, the message."""

from __future__ import annotations

import copy
import json

import pytest
from hybridflow.exceptions import ConfigError, DataQualityError, HybridflowError
from hybridflow.pipeline import quality
from hybridflow.pipeline.quality import Status

CONTRACT = quality.parse_contract({
    "schema": [
        {"name": "customer_id", "type": "string", "role": "key"},
        {"name": "label", "type": "int32", "role": "label"},
        {"name": "f_a", "type": "float32", "role": "feature"},
        {"name": "f_b", "type": "float32", "role": "feature"},
        {"name": "f_c", "type": "float64", "role": "feature"},
    ],
    "thresholds": {
        "min_rows": 100,
        "row_count_change": {"min_ratio": 0.5, "max_ratio": 2.0},
        "max_null_ratio": {"default": 0.01, "per_column": {"customer_id": 0.0, "label": 0.0}},
        "max_nan_ratio": 0.0,
        "max_quarantine_ratio": 0.05,
        "label_rate": {"min": 0.05, "max": 0.5},
    },
})


def manifest(**changes) -> dict:
    base = {
        "dataset": "features",
        "ds": "2026-01-05",
        "row_count": 1000,
        "columns": [{"name": "customer_id", "type": "string"}, {"name": "label", "type": "int32"},
                    {"name": "f_a", "type": "float32"}, {"name": "f_b", "type": "float32"},
                    {"name": "f_c", "type": "float64"}],
        "feature_columns": ["f_a", "f_b", "f_c"],
        "null_ratio": {"customer_id": 0.0, "label": 0.0, "f_a": 0.0, "f_b": 0.0, "f_c": 0.0},
        "nan_ratio": {"f_a": 0.0, "f_b": 0.0, "f_c": 0.0},
        "label_rate": 0.2,
        "quarantine": {"rows": 200, "ratio": 0.02,
                       "by_reason": {"bad_timestamp": 150, "negative_amount": 50}},
    }
    base.update(changes)
    return base


def failures(results) -> list[tuple]:
    return [(r.check, r.column, r.observed, r.expected) for r in results if r.failed]


def test_quality_valid_manifest_passes_every_check():
    results = quality.run_checks(manifest(), manifest(ds="2026-01-04"), CONTRACT)
    assert failures(results) == []
    assert quality.enforce(results) == results
    assert quality.summary(results)["failed"] == 0


def _retype(m, name, type_):
    m["columns"] = [dict(c, type=type_) if c["name"] == name else c for c in m["columns"]]
    return m


def _drop(m, name):
    m["columns"] = [c for c in m["columns"] if c["name"] != name]
    return m


@pytest.mark.parametrize("mutate, expected", [
    (lambda m: _retype(m, "f_b", "string"), [("schema.type", "f_b", "string", "float32")]),
    (lambda m: _retype(m, "f_c", "float32"), [("schema.type", "f_c", "float32", "float64")]),
    (lambda m: _retype(m, "label", "int64"), [("schema.type", "label", "int64", "int32")]),
    (lambda m: _drop(m, "f_a"), [("schema.missing_column", "f_a", "absent", "float32")]),
    (lambda m: m["columns"].append({"name": "f_new", "type": "float32"}) or m,
     [("schema.unexpected_column", "f_new", "float32", "not in the declared schema")]),
    (lambda m: m.update(feature_columns=["f_b", "f_a", "f_c"]) or m,
     [("schema.feature_order", "f_b", "feature_columns[0]=f_b (3 features)",
       "feature_columns[0]=f_a (3 features)")]),
    (lambda m: m.update(feature_columns=["f_a", "f_b"]) or m,
     [("schema.feature_order", "<end>", "feature_columns[2]=<end> (2 features)",
       "feature_columns[2]=f_c (3 features)")]),
])
def test_quality_schema_drift(mutate, expected):
    assert failures(quality.check_schema(mutate(copy.deepcopy(manifest())), CONTRACT)) == expected


@pytest.mark.parametrize("rows, previous_rows, expected", [
    (1000, None, [Status.PASSED, Status.SKIPPED]),
    (1000, 0, [Status.PASSED, Status.SKIPPED]),
    (1000, 1000, [Status.PASSED, Status.PASSED]),
    (500, 1000, [Status.PASSED, Status.PASSED]),
    (2000, 1000, [Status.PASSED, Status.PASSED]),
    (499, 1000, [Status.PASSED, Status.FAILED]),
    (2001, 1000, [Status.PASSED, Status.FAILED]),
    (99, None, [Status.FAILED, Status.SKIPPED]),
    (0, 1000, [Status.FAILED, Status.FAILED]),
])
def test_quality_row_count(rows, previous_rows, expected):
    previous = None if previous_rows is None else manifest(ds="2026-01-04", row_count=previous_rows)
    results = quality.check_row_count(manifest(row_count=rows), previous, CONTRACT)
    assert [r.status for r in results] == expected


def test_quality_row_count_change_names_previous_partition():
    (_, change) = quality.check_row_count(manifest(row_count=400), manifest(ds="2026-01-04"), CONTRACT)
    assert change.describe() == ("row_count.change: observed 400 rows = 0.4 x previous, "
                                 "expected within [0.5, 2] x 1000 rows (ds=2026-01-04)")


@pytest.mark.parametrize("null_ratio, nan_ratio, expected", [
    ({"f_a": 0.01}, {}, []),
    ({"f_a": 0.0101}, {}, [("null_ratio", "f_a", 0.0101, "<= 0.01")]),
    ({"customer_id": 0.001}, {}, [("null_ratio", "customer_id", 0.001, "<= 0")]),
    ({"label": 0.5}, {}, [("null_ratio", "label", 0.5, "<= 0")]),
    ({}, {"f_c": 0.001}, [("nan_ratio", "f_c", 0.001, "<= 0")]),
])
def test_quality_null_and_nan_ratios(null_ratio, nan_ratio, expected):
    m = manifest()
    m["null_ratio"].update(null_ratio)
    m["nan_ratio"].update(nan_ratio)
    assert failures(quality.check_null_ratios(m, CONTRACT)) == expected


def test_quality_null_ratio_not_reported_for_a_declared_column_fails():
    m = manifest()
    del m["null_ratio"]["f_b"]
    expected = [("null_ratio", "f_b", "not reported", "<= 0.01")]
    assert failures(quality.check_null_ratios(m, CONTRACT)) == expected


@pytest.mark.parametrize("section, ok, observed", [
    ({"rows": 200, "ratio": 0.02, "by_reason": {"a": 150, "b": 50}}, True, "0.02 (200 rows, most: a=150)"),
    ({"rows": 500, "ratio": 0.05, "by_reason": {}}, True, "0.05 (500 rows)"),
    ({"rows": 510, "ratio": 0.051, "by_reason": {"bad_timestamp": 510}}, False,
     "0.051 (510 rows, most: bad_timestamp=510)"),
    ({"rows": 0, "ratio": 0.0, "by_reason": {"a": 0}}, True, "0 (0 rows)"),
    ({}, False, "not reported"),
])
def test_quality_quarantine_ratio(section, ok, observed):
    (result,) = quality.check_quarantine_ratio(manifest(quarantine=section), CONTRACT)
    assert (result.failed, result.observed, result.expected) == (not ok, observed, "<= 0.05")


@pytest.mark.parametrize("rate, ok", [(0.05, True), (0.5, True), (0.049, False), (0.51, False),
                                      (None, False)])
def test_quality_label_rate(rate, ok):
    (result,) = quality.check_label_rate(manifest(label_rate=rate), CONTRACT)
    assert result.failed is not ok
    assert result.expected == "within [0.05, 0.5]"


def test_quality_label_rate_without_bounds_is_not_checked():
    contract = quality.parse_contract({"schema": [{"name": "f", "type": "float32", "role": "feature"}]})
    assert quality.check_label_rate(manifest(), contract) == []


def test_quality_null_ratio_of_an_absent_column_is_left_to_the_schema_check():
    m = _drop(manifest(), "f_b")
    del m["null_ratio"]["f_b"]
    (result,) = [r for r in quality.check_null_ratios(m, CONTRACT)
                 if r.check == "null_ratio" and r.column == "f_b"]
    assert result.status is Status.SKIPPED
    assert failures(quality.run_checks(m, None, CONTRACT)) == [("schema.missing_column", "f_b", "absent",
                                                                  "float32")]


def test_quality_manifest_missing_keys_stops_before_other_checks():
    m = manifest()
    del m["quarantine"], m["null_ratio"]
    results = quality.run_checks(m, None, CONTRACT)
    assert failures(results) == [("manifest", "null_ratio", "absent", "present"),
                                 ("manifest", "quarantine", "absent", "present")]


def test_quality_gate_error_names_check_column_observed_expected_and_runbook():
    drifted = _retype(_drop(manifest(), "f_a"), "f_b", "string")
    with pytest.raises(DataQualityError) as caught:
        quality.gate(drifted, None, CONTRACT)
    text = str(caught.value)
    head = "data quality gate failed for features ds=2026-01-05: 2 of 24 checks failed"
    assert text.splitlines()[0] == head
    assert "  - schema.missing_column column=f_a: observed absent, expected float32" in text
    assert "  - schema.type column=f_b: observed string, expected float32" in text
    assert text.endswith("Runbook: include/runbooks/data-quality.md")
    assert isinstance(caught.value, HybridflowError)
    assert len(caught.value.results) == 24 and sum(r.failed for r in caught.value.results) == 2


def test_quality_failure_message_is_capped():
    results = [quality.CheckResult("null_ratio", f"c{i}", Status.FAILED, 1.0, "<= 0") for i in range(25)]
    text = quality.failure_message(results, "2026-01-05", limit=3)
    assert text.count("  - null_ratio") == 3
    assert "... and 22 more" in text


def test_quality_summary_is_json_serialisable():
    results = quality.run_checks(manifest(row_count=10), None, CONTRACT)
    summary = json.loads(json.dumps(quality.summary(results)))
    assert summary["failed"] == 1 and summary["skipped"] == 1
    assert summary["failures"] == [{"check": "row_count.min", "column": None, "status": "failed",
                                    "observed": 10, "expected": ">= 100"}]


def _contract_with(**changes):
    data = {"schema": [{"name": "f", "type": "float32", "role": "feature"}], "thresholds": {}}
    data.update(changes)
    return data


@pytest.mark.parametrize("data, message", [
    ({"schema": []}, r"schema: \[\]; expected a non-empty list"),
    (_contract_with(schema=[{"name": "f", "type": "float32"}]), r"schema\[0\]\.role: missing"),
    (_contract_with(schema=[{"name": "f", "type": "float32", "role": "feature", "unit": "s"}]),
     r"schema\[0\]: unknown key\(s\) unit"),
    (_contract_with(schema=[{"name": "f", "type": "double", "role": "feature"}]),
     r"schema\[0\]\.type: 'double' \(column f\); expected one of"),
    (_contract_with(schema=[{"name": "f", "type": "float32", "role": "target"}]),
     r"schema\[0\]\.role: 'target' \(column f\); expected one of"),
    (_contract_with(schema=[{"name": "f", "type": "int32", "role": "feature"}]), "float32 or float64"),
    (_contract_with(schema=[{"name": "f", "type": "float32", "role": "feature"}] * 2), "f more than once"),
    (_contract_with(schema=[{"name": "k", "type": "string", "role": "key"}]),
     "no column with role 'feature'"),
    (_contract_with(thresholds={"max_quarantine_ratio": -1}),
     "thresholds.max_quarantine_ratio: -1; expected a number >= 0"),
    (_contract_with(thresholds={"min_rows": 1.5}), "thresholds.min_rows: 1.5; expected an integer >= 0"),
    (_contract_with(thresholds={"max_null_ratio": {"per_column": {"g": 0.1}}}),
     "thresholds.max_null_ratio.per_column: g; name only columns the schema declares"),
    (_contract_with(thresholds={"row_count_change": {"min_ratio": 3, "max_ratio": 2}}),
     r"thresholds.row_count_change.min_ratio: 3; expected at most max_ratio \(2\)"),
    (_contract_with(thresholds=[1]), "thresholds: expected a mapping, got list"),
])
def test_quality_contract_rejects(data, message):
    with pytest.raises(ConfigError, match=f"^features.json: .*{message}"):
        quality.parse_contract(data, "features.json")


def test_quality_checked_in_contract_loads():
    contract = quality.load_contract()
    assert contract.feature_columns[0] == "log_events_1d"
    assert contract.types["label"] == "int32"
    assert contract.thresholds.null_limit("customer_id") == 0.0


def test_quality_load_contract_names_a_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        quality.load_contract(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        quality.load_contract(tmp_path / "bad.json")


@pytest.mark.parametrize("published, ds, expected", [
    ([], "2026-01-05", None),
    (["2026-01-05"], "2026-01-05", None),
    (["2026-01-01", "2026-01-04", "2026-01-07"], "2026-01-05", "2026-01-04"),
    (["2025-12-31"], "2026-01-01", "2025-12-31"),
])
def test_quality_previous_ds(published, ds, expected):
    assert quality.previous_ds(published, ds) == expected


def test_quality_gate_fails_a_partition_that_is_not_published_and_passes_a_published_one():
    assert quality.require_published({"ds": "2026-01-05"}, "s3://b/features/ds=2026-01-05") == {"ds": "2026-01-05"}
    with pytest.raises(DataQualityError, match="published: observed no _SUCCESS in s3://b/features/ds=2026-01-04"):
        quality.require_published(None, "s3://b/features/ds=2026-01-04")


def test_quality_module_uses_only_the_standard_library():
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(quality.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__", "hybridflow"} <= set(sys.stdlib_module_names)
