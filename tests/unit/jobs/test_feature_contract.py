"""The features job, the generator and the declared contract in include/config/features.json agree."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from hybridjobs import features, generator, storage
from hybridjobs.spark import MANIFEST_TYPES, package_zip

REPO = Path(__file__).resolve().parents[3]

CONTRACT = json.loads((REPO / "include" / "config" / "features.json").read_text())


def test_declared_schema_is_what_the_features_job_writes():
    declared = [(c["name"], c["role"]) for c in CONTRACT["schema"]]
    assert [name for name, _ in declared] == list(features.OUTPUT_COLUMNS)
    assert [name for name, role in declared if role == "feature"] == list(features.FEATURE_COLUMNS)
    types = {c["name"]: c["type"] for c in CONTRACT["schema"]}
    assert types["customer_id"] == MANIFEST_TYPES["string"]
    assert types["label"] == MANIFEST_TYPES["int"]
    assert {types[c] for c in features.FEATURE_COLUMNS} == {MANIFEST_TYPES["float"]}


def test_generator_defects_are_the_quarantine_reasons():
    assert generator.DEFECT_KINDS == features.QUARANTINE_REASONS


@pytest.mark.parametrize("name", ["RAW_COLUMNS", "EVENT_TYPES", "CHANNELS", "DEVICES"])
def test_generator_and_features_share_vocabularies(name):
    assert getattr(generator, name) == getattr(features, name)


def test_features_job_fails_clearly_without_raw_partition(tmp_path):
    """The check happens before any Spark work, so no session is needed to see it."""
    with pytest.raises(storage.PartitionNotPublishedError, match="raw partition .* is not published"):
        features.read_raw_events(None, str(tmp_path), "2026-01-05", ["2026-01-05"])


def test_package_zip_ships_every_module_of_hybridjobs():
    names = set(zipfile.ZipFile(package_zip()).namelist())
    modules = {f"hybridjobs/{p.name}" for p in (REPO / "jobs" / "hybridjobs").glob("*.py")}
    assert modules <= names


@pytest.mark.parametrize("path", [*sorted((REPO / "jobs" / "hybridjobs").glob("*.py")),
                                  *(REPO / "jobs" / name for name in ("generate_raw.py", "build_features.py",
                                                                      "score_batch.py"))],
                         ids=lambda p: p.name)
def test_spark_jobs_never_import_airflow_or_the_package(path):
    import ast

    tree = ast.parse(path.read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    forbidden = modules & {"airflow", "hybridflow"}
    assert not forbidden, f"{path} imports {sorted(forbidden)}: jobs run on the clusters without them"
