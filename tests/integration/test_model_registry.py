"""The model registry on the stack's real MLflow server: versions from training runs (files copied once, a retry
adds no version), the champion alias moved by compare-and-set (two promotions at once: one wins, the other is
told), on-call rollback to the champion before, the earlier file registry imported once, hostile values stored
verbatim, and a server that does not answer named with the fix. Each test has a registered model of its own."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from hybridflow.exceptions import MlflowUnavailable
from hybridflow.hooks.mlflow import MlflowHook
from hybridflow.pipeline.registry import (
    EXPORT_FILES,
    LOCK_SUFFIX,
    ModelRegistry,
    RegistryError,
    file_sha256,
    import_json_registry,
)


def export(root: Path, name: str, weights: bytes) -> Path:
    directory = root / name / "export"
    directory.mkdir(parents=True)
    (directory / "model.pt").write_bytes(weights)
    (directory / "signature.json").write_text(json.dumps({"inputs": 4}))
    (directory / "smoke.json").write_text(json.dumps({"rows": []}))
    return directory


def training_run(mlflow: MlflowHook, directory: Path) -> str:
    """An MLflow run holding the export as its model artifacts, as a training task leaves one."""
    run = mlflow.create_run(mlflow.experiment_id("tests"), f"registry-{directory.parent.name}", {},
                            int(time.time() * 1000))
    for name in EXPORT_FILES:
        mlflow.upload_artifact(run["info"]["artifact_uri"], f"model/{name}", (directory / name).read_bytes())
    return run["info"]["run_id"]


@pytest.fixture
def registry(stack, tmp_path):
    mlflow = MlflowHook()
    name = f"test-registry-{uuid.uuid4().hex[:8]}"
    yield ModelRegistry(mlflow, str(tmp_path / "storage"), name)
    mlflow.delete_registered_model(name)
    mlflow.delete_registered_model(name + LOCK_SUFFIX)


def registered(registry: ModelRegistry, tmp_path: Path, name: str, weights: bytes, **details) -> dict:
    directory = export(tmp_path, name, weights)
    return registry.register(str(directory), run_id=training_run(registry.mlflow, directory),
                             details={"airflow_run_id": name, **details})


def test_versions_come_from_runs_are_made_once_and_the_champion_moves_and_rolls_back(registry, tmp_path):
    assert registry.champion() is None and registry.version(1) is None  # a model never registered: none yet
    directory = export(tmp_path, "night-1", b"one")
    run_id = training_run(registry.mlflow, directory)
    hostile = "x' OR name LIKE '%\n<script>alert(1)</script> ${{ params }}"
    first = registry.register(str(directory), run_id=run_id, details={"airflow_run_id": hostile, "auc": 0.8})
    again = registry.register(str(directory), run_id=run_id, details={"airflow_run_id": hostile, "auc": 0.8})
    assert first["version"] == again["version"] == 1  # a retried task adds no version
    assert len(registry.mlflow.search_model_versions(registry.model_name)) == 1
    assert first["run_id"] == run_id and first["source"] == f"runs:/{run_id}/model"
    assert first["airflow_run_id"] == hostile and first["auc"] == 0.8  # stored verbatim, never interpreted
    assert first["aliases"] == ["challenger"] and registry.champion() is None
    files = Path(first["export_dir"])
    assert files.name == f"v1-{file_sha256(directory / 'model.pt')[:12]}"
    assert (files / "model.pt").read_bytes() == b"one"

    assert registry.promote(1, expected_champion=None, reason="first model").promoted
    assert registry.promote(1, expected_champion=None, reason="first model").promoted  # a retry: no second move
    second = registered(registry, tmp_path, "night-2", b"two", auc=0.82)
    promotion = registry.promote(second["version"], expected_champion=1, reason="AUC +0.02 >= margin 0.005")
    assert (promotion.promoted, promotion.champion) == (True, 2)
    champion = registry.champion()
    assert champion["version"] == 2 and set(champion["aliases"]) == {"champion", "challenger"}
    assert champion["previous_champion"] == 1
    assert champion["tags"]["hybridflow.promotion_reason"] == "AUC +0.02 >= margin 0.005"

    back = registry.roll_back(reason="on-call: bad predictions")
    assert (back.promoted, back.champion) == (True, 1) and registry.champion()["version"] == 1
    assert "on-call: bad predictions" in registry.version(2)["tags"]["hybridflow.rolled_back"]
    with pytest.raises(RegistryError, match="replaced no earlier champion"):
        registry.roll_back(reason="again")  # v1 was the first: nothing before it, nothing moved
    assert registry.champion()["version"] == 1


def test_two_promotions_at_once_one_wins_and_the_other_is_told(registry, tmp_path):
    base = registered(registry, tmp_path, "base", b"base")
    registry.promote(base["version"], expected_champion=None, reason="first")
    contenders = [registered(registry, tmp_path, f"night-{i}", f"w{i}".encode())["version"] for i in (1, 2)]
    outcomes: dict[int, object] = {}
    start = threading.Barrier(2)

    def promote(version: int) -> None:
        start.wait()
        outcomes[version] = registry.promote(version, expected_champion=base["version"], reason=f"v{version} wins")

    threads = [threading.Thread(target=promote, args=(v,)) for v in contenders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    winners = [v for v, outcome in outcomes.items() if outcome.promoted]
    assert len(outcomes) == 2 and len(winners) == 1, outcomes
    (loser,) = set(contenders) - set(winners)
    assert registry.champion()["version"] == winners[0] == outcomes[loser].champion
    assert f"champion moved to v{winners[0]}" in outcomes[loser].message
    assert "champion moved" in registry.version(loser)["tags"]["hybridflow.promotion"]  # its decision is kept
    assert registry.mlflow.registered_model(registry.model_name + LOCK_SUFFIX) is None  # the lock is released


def test_a_held_promotion_lock_is_waited_for_then_named(registry, tmp_path):
    version = registered(registry, tmp_path, "night", b"w")["version"]
    assert registry.mlflow.create_registered_model(registry.model_name + LOCK_SUFFIX)
    with pytest.raises(RegistryError, match=rf"{registry.model_name}{LOCK_SUFFIX}.*another promotion runs"):
        registry.promote(version, expected_champion=None, reason="r", wait_s=1)
    assert registry.champion() is None  # nothing moved


def test_the_file_registry_is_imported_once_in_order_with_its_champion(registry, tmp_path):
    root = registry.root
    history = []
    for number, weights in ((1, b"one"), (2, b"two"), (3, b"three")):
        version_dir = root / f"v{number}"
        version_dir.mkdir(parents=True)
        for name in EXPORT_FILES:
            (version_dir / name).write_bytes(weights if name == "model.pt" else b"{}")
        history.append({"version": number, "export_dir": str(version_dir), "model_path": str(version_dir / "model.pt"),
                        "sha256": file_sha256(version_dir / "model.pt"), "run_id": f"night-{number}",
                        "auc": 0.7 + number / 100, "decision": "promote", "reason": f"night {number}"})
    path = root / "registry.json"
    text = json.dumps({"model_name": registry.model_name, "champion": history[1], "history": history})
    path.write_text(text)

    result = import_json_registry(registry, path)
    assert result["versions"] == {1: 1, 2: 2, 3: 3} and result["champion"] == 2
    assert not path.exists() and Path(result["file"]).read_text() == text  # kept, renamed: one registry
    champion = registry.champion()
    assert champion["export_dir"] == str(root / "v2") and champion["airflow_run_id"] == "night-2"
    assert champion["previous_champion"] == 1 and champion["auc"] == pytest.approx(0.72)
    assert registry.version(3)["source"].startswith("runs:/")

    path.write_text(text)  # imported again (a second `make up` that found it back): nothing twice
    assert import_json_registry(registry, path)["versions"] == {1: 1, 2: 2, 3: 3}
    assert len(registry.mlflow.search_model_versions(registry.model_name)) == 3
    assert registry.champion()["version"] == 2


def test_an_mlflow_server_that_does_not_answer_is_named_with_the_fix(stack, tmp_path, monkeypatch):
    conn = json.loads(stack["AIRFLOW_CONN_MLFLOW_DEFAULT"]) | {"port": 9}
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DOWN", json.dumps(conn))
    registry = ModelRegistry(MlflowHook("mlflow_down"), str(tmp_path / "storage"), "propensity")
    with pytest.raises(MlflowUnavailable, match=r"127\.0\.0\.1:9.*make status.*mlflow_down"):
        registry.champion()
    directory = export(tmp_path, "night", b"w")
    with pytest.raises(MlflowUnavailable):
        registry.register(str(directory), run_id="ab" * 16, details={})
    assert not registry.root.exists()  # no files copied for a version that does not exist


def test_evaluation_with_mlflow_down_fails_naming_the_server_and_its_retry_registers_once(
        stack, cluster_tmp_path, monkeypatch):
    """The evaluation task's body (decide_and_publish) on a run directory as the training and evaluation jobs leave
    it: with MLflow down it fails naming the server and changes nothing; its retry once the server answers
    registers one version and makes it the champion; a second retry adds no version and moves no alias."""
    from dataclasses import replace

    from hybridflow.config import pipeline_config
    from hybridflow.pipeline import nightly_tasks

    config = pipeline_config()
    config = replace(config, nightly=replace(config.nightly, model_name=f"test-eval-{uuid.uuid4().hex[:8]}"))
    mlflow = MlflowHook()
    run_dir = cluster_tmp_path / "run"
    directory = export(cluster_tmp_path, "run", b"weights")
    (run_dir / "evaluation.json").write_text(json.dumps(
        {"challenger": {"auc": 0.8, "log_loss": 0.4}, "champion": None, "holdout_rows": 100}))
    (run_dir / "mlflow_run.json").write_text(json.dumps({"run_id": training_run(mlflow, directory)}))
    prepared = {"run_dir": str(run_dir), "champion_version": None, "train_ds": "2026-01-01"}
    conn = json.loads(stack["AIRFLOW_CONN_MLFLOW_DEFAULT"]) | {"port": 9}
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DOWN", json.dumps(conn))
    real = nightly_tasks.model_registry
    try:
        monkeypatch.setattr(nightly_tasks, "model_registry", lambda c: ModelRegistry(
            MlflowHook("mlflow_down"), c.storage.root, c.nightly.model_name))
        with pytest.raises(MlflowUnavailable, match=r"127\.0\.0\.1:9.*make status"):
            nightly_tasks.decide_and_publish(config, prepared, "2026-01-01", "manual__eval")
        assert not Path(config.storage.layout.model_dir(config.nightly.model_name)).exists()

        monkeypatch.setattr(nightly_tasks, "model_registry", real)
        first = nightly_tasks.decide_and_publish(config, prepared, "2026-01-01", "manual__eval")
        again = nightly_tasks.decide_and_publish(config, prepared, "2026-01-01", "manual__eval")
        assert first["decision"] == "first_model" and first["promoted_version"] == first["registered_version"] == 1
        assert again["registered_version"] == 1 and again["promoted_version"] == 1
        registry = real(config)
        assert len(mlflow.search_model_versions(config.nightly.model_name)) == 1
        assert registry.champion()["version"] == 1
    finally:
        mlflow.delete_registered_model(config.nightly.model_name)
        shutil.rmtree(config.storage.layout.model_dir(config.nightly.model_name), ignore_errors=True)


DEPLOY_REPORT = {"model": "propensity_rt", "version": 7, "promoted": True, "slo_p99_ms": 50,
                 "smoke": {"rows": 8, "max_abs_error": 1e-7}, "latency": {"p99_ms": 12.5}}


def test_recording_a_deploy_with_mlflow_down_fails_naming_the_server_and_its_retry_tags_once(
        registry, stack, tmp_path, monkeypatch):
    """The record task's body tags the served registry version with its Triton model and version and what the
    deploy decided; with MLflow down it fails naming the server, its retry tags the version once."""
    version = registered(registry, tmp_path, "night-1", b"one")["version"]
    conn = json.loads(stack["AIRFLOW_CONN_MLFLOW_DEFAULT"]) | {"port": 9}
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DOWN", json.dumps(conn))
    down = ModelRegistry(MlflowHook("mlflow_down"), str(tmp_path / "storage"), registry.model_name)
    with pytest.raises(MlflowUnavailable, match=r"127\.0\.0\.1:9.*make status"):
        down.record_deploy(version, DEPLOY_REPORT)
    hostile = {**DEPLOY_REPORT, "promoted": False, "reason": "latency gate failed: p99 '; DROP TABLE x; -- \n${x}"}
    for _ in range(2):  # the retry, then a second one
        registry.record_deploy(version, hostile)
    tags = registry.version(version)["tags"]
    assert (tags["hybridflow.triton_model"], tags["hybridflow.triton_version"]) == ("propensity_rt", "7")
    assert tags["hybridflow.deploy"].endswith(
        "Triton propensity_rt version 7 rolled back: latency gate failed: p99 '; DROP TABLE x; -- \n${x}; "
        "smoke max abs error 1e-07 over 8 rows; p99 12.5 ms (SLO 50 ms)")  # verbatim, never interpreted
    assert len(registry.mlflow.search_model_versions(registry.model_name)) == 1
    assert registry.version(version)["aliases"] == ["challenger"]  # recording moves no alias


def test_an_oncall_rollback_of_triton_moves_the_champion_to_the_version_it_restored(registry, tmp_path):
    one = registered(registry, tmp_path, "night-1", b"one")["version"]
    registry.promote(one, expected_champion=None, reason="first model")
    two = registered(registry, tmp_path, "night-2", b"two")["version"]
    registry.promote(two, expected_champion=one, reason="better")
    restored = {"model": "propensity_rt", "version": 3, "rolled_back_from": 4,
                "model_uri": f"models:/{registry.model_name}/{one}"}
    for _ in range(2):  # the on-call task and its retry
        moved = registry.record_triton_rollback(restored)
        assert moved.startswith(f"champion is models:/{registry.model_name}/{one}"), moved
        assert registry.champion()["version"] == one
    assert registry.version(two)["tags"]["hybridflow.rolled_back"].endswith(
        "on-call rollback of Triton propensity_rt version 3 (from version 4)")
    # A Triton version deployed by hand, or serving another registered model, moves nothing and says why.
    assert "deployed outside the pipeline" in registry.record_triton_rollback({**restored, "model_uri": ""})
    assert "not a version of" in registry.record_triton_rollback({**restored, "model_uri": "models:/other/2"})
    with pytest.raises(RegistryError, match="which MLflow does not have"):
        registry.record_triton_rollback({**restored, "model_uri": f"models:/{registry.model_name}/99"})
    for hostile in ("models:/../1", f"models:/{registry.model_name}/1; rm -rf /", "runs:/abc/model", 7):
        with pytest.raises(RegistryError, match="model_uri: .* is not a registry version"):
            registry.record_triton_rollback({**restored, "model_uri": hostile})
    assert registry.champion()["version"] == one
