"""The model of record on the shared storage: numbered versions, atomic promotion, idempotent retries."""

from __future__ import annotations

import json

import pytest
from hybridflow.pipeline.registry import ModelRegistry, RegistryError


def export(tmp_path, name: str, payload: bytes):
    directory = tmp_path / name / "export"
    directory.mkdir(parents=True)
    (directory / "model.pt").write_bytes(payload)
    (directory / "signature.json").write_text("{}")
    (directory / "smoke.json").write_text("{}")
    return directory


def test_registry_promotes_numbered_versions_and_names_the_champion(tmp_path):
    registry = ModelRegistry(str(tmp_path / "storage"), "propensity")
    assert registry.champion() is None
    first = registry.promote(str(export(tmp_path, "run1", b"one")), {"run_id": "r1", "auc": 0.8})
    second = registry.promote(str(export(tmp_path, "run2", b"two")), {"run_id": "r2", "auc": 0.82})
    assert (first["version"], second["version"]) == (1, 2)
    assert registry.champion()["version"] == 2
    assert (registry.version_dir(1) / "model.pt").read_bytes() == b"one"
    assert json.loads((registry.version_dir(2) / "promotion.json").read_text())["run_id"] == "r2"
    assert [r["version"] for r in registry.read()["history"]] == [1, 2]
    assert not list((tmp_path / "storage/models/propensity").glob(".v*"))  # no staging left behind


def test_registry_retry_of_the_same_promotion_returns_the_same_version(tmp_path):
    registry = ModelRegistry(str(tmp_path), "m")
    source = str(export(tmp_path, "run", b"weights"))
    assert registry.promote(source, {"run_id": "r"})["version"] == 1
    assert registry.promote(source, {"run_id": "r"})["version"] == 1
    assert len(registry.read()["history"]) == 1


def test_registry_refuses_an_unfinished_export_and_changes_nothing(tmp_path):
    registry = ModelRegistry(str(tmp_path), "m")
    source = export(tmp_path, "run", b"w")
    (source / "smoke.json").unlink()
    with pytest.raises(RegistryError, match="lacks smoke.json"):
        registry.promote(str(source), {"run_id": "r"})
    assert registry.champion() is None and not registry.version_dir(1).exists()


def test_registry_corrupt_file_is_a_clear_error(tmp_path):
    registry = ModelRegistry(str(tmp_path), "m")
    registry.root.mkdir(parents=True)
    registry.registry_path.write_text("{not json")
    with pytest.raises(RegistryError, match="registry.json cannot be read"):
        registry.champion()
