"""The model registry, on MLflow: registered model ``<name>`` (``nightly.model_name``), one version per trained
model whose source is its training run's model artifacts, aliases ``champion`` (the model of record) and
``challenger`` (the newest trained model).

The files a cluster job or Triton reads stay on the shared storage: ``<root>/models/<name>/v<N>-<sha12>/`` (N =
the MLflow version, then the model's digest; tag ``hybridflow.model_dir``) holds the export (model.pt,
signature.json, smoke.json), copied under a temporary name and renamed into place, never overwritten.
Registering the same run's model again (a retried task) returns the version it already made; promotion is a
compare-and-set of the champion alias under a lock that MLflow itself makes atomic (a registered model
``<name>.promotion-lock`` exists while one promotion runs), so two runs promoting at once never both win and the
loser is told who did.

``python -m hybridflow.pipeline.registry import-json`` imports a ``registry.json`` of the suite's earlier file
registry once (``make up`` runs it): every version in order, the model of record as champion, then the file is
renamed ``registry.json.imported``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.atomic import staged_dir
from hybridflow.exceptions import HybridflowError
from hybridflow.layout import EXPORT_FILES, MODEL_FILE, StorageLayout
from hybridflow.utils.mlflow_tracking import clip

if TYPE_CHECKING:
    from hybridflow.hooks.mlflow import MlflowHook

CHAMPION = "champion"
CHALLENGER = "challenger"
TAG_MODEL_DIR = "hybridflow.model_dir"
TAG_SHA256 = "hybridflow.sha256"
TAG_PREVIOUS_CHAMPION = "hybridflow.previous_champion"
TAG_IMPORTED_FROM = "hybridflow.imported_from_version"
LOCK_SUFFIX = ".promotion-lock"
LOCK_STALE_S = 600  # a promotion takes seconds: a lock this old was left by a killed task
IMPORT_EXPERIMENT = "model_registry_import"
TAG_ROLLED_BACK = "hybridflow.rolled_back"
# Registered model names the config allows (nightly.model_name); a version URI names one of them and a number.
VERSION_URI = re.compile(r"models:/([A-Za-z0-9_-]{1,64})/([1-9][0-9]{0,9})")


class RegistryError(HybridflowError):
    """The registry or an export is missing or inconsistent; the message names what and the fix."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def version_record(model_version: Mapping[str, Any]) -> dict[str, Any]:
    """What the pipeline needs of one MLflow model version: its number, files, run and figures (from its tags)."""
    tags = {t["key"]: t["value"] for t in model_version.get("tags") or []}
    model_dir = tags.get(TAG_MODEL_DIR)
    previous = tags.get(TAG_PREVIOUS_CHAMPION, "")
    return {
        "version": int(model_version["version"]),
        "run_id": model_version.get("run_id") or None,
        "source": model_version.get("source"),
        "aliases": list(model_version.get("aliases") or []),
        "export_dir": model_dir,
        "model_path": f"{model_dir}/{MODEL_FILE}" if model_dir else None,
        "sha256": tags.get(TAG_SHA256),
        "auc": _number(tags.get("hybridflow.holdout_auc")),
        "log_loss": _number(tags.get("hybridflow.holdout_log_loss")),
        "airflow_run_id": tags.get("hybridflow.airflow_run_id"),
        "ds": tags.get("hybridflow.ds"),
        "previous_champion": int(previous) if previous.isdigit() else None,
        "tags": tags,
    }


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse_version_uri(uri: Any, field: str = "model_uri") -> tuple[str, int]:
    """(registered model, version) of ``models:/<name>/<N>``; anything else is refused naming the field."""
    found = VERSION_URI.fullmatch(uri) if isinstance(uri, str) else None
    if found is None:
        raise RegistryError(f"{field}: {str(uri)[:200]!r} is not a registry version; give models:/<name>/<N> (the "
                            "name from nightly.model_name, N the MLflow version)")
    return found.group(1), int(found.group(2))


def deploy_tags(report: Mapping[str, Any], at: str) -> dict[str, str]:
    """The registry version's side of the link to Triton: which model and version serve it, and what the deploy
    decided and why (its figures, or the reason it rolled back)."""
    model, version = report.get("model"), report.get("version")
    smoke, latency = report.get("smoke") or {}, report.get("latency") or {}
    figures = "; ".join(part for part in (
        f"smoke max abs error {smoke['max_abs_error']:.3g} over {smoke.get('rows')} rows"
        if isinstance(smoke.get("max_abs_error"), int | float) else "",
        f"p99 {latency['p99_ms']:.1f} ms (SLO {report.get('slo_p99_ms')} ms)"
        if isinstance(latency.get("p99_ms"), int | float) else "") if part)
    outcome = "promoted" if report.get("promoted") else f"rolled back: {report.get('reason') or 'no reason given'}"
    decisions = [part for part in ((latency.get("decision") and f"gate {latency['decision']}"),
                                   ((report.get("release") or {}).get("decision"))) if part]
    summary = (f"{at}: Triton {model} version {version} {outcome}" + (f"; {figures}" if figures else "")
               + "".join(f". {decision}" for decision in decisions))
    return {"hybridflow.triton_model": clip(model), "hybridflow.triton_version": clip(version),
            "hybridflow.deploy": clip(summary)}


def scoring_tags(ds: str, rows: Any, airflow_run_id: str) -> dict[str, str]:
    """What the champion last scored: the partition, its rows and the Airflow run that scored it."""
    return {"hybridflow.last_scored_ds": clip(ds), "hybridflow.last_scored_rows": clip(rows),
            "hybridflow.last_scored_by": clip(airflow_run_id)}


def version_tags(details: Mapping[str, Any]) -> dict[str, str]:
    """A new version's tags from what the pipeline knows of it (absent values left out)."""
    keys = {"airflow_run_id": "hybridflow.airflow_run_id", "ds": "hybridflow.ds", "train_ds": "hybridflow.train_ds",
            "auc": "hybridflow.holdout_auc", "log_loss": "hybridflow.holdout_log_loss",
            "decision": "hybridflow.decision", "reason": "hybridflow.decision_reason"}
    return {tag: str(details[key]) for key, tag in keys.items() if details.get(key) is not None}


@dataclass(frozen=True)
class Promotion:
    """The outcome of a compare-and-set of the champion alias."""

    promoted: bool
    champion: int | None  # the champion after the call
    message: str


class ModelRegistry:
    def __init__(self, mlflow: MlflowHook, storage_root: str, model_name: str):
        self.mlflow = mlflow
        self.model_name = model_name
        self.layout = StorageLayout(storage_root)
        self.root = Path(self.layout.model_dir(model_name))

    @property
    def champion_uri(self) -> str:
        return f"models:/{self.model_name}@{CHAMPION}"

    def version_dir(self, version: int, sha256: str) -> Path:
        return Path(self.layout.model_version_dir(self.model_name, version, sha256))

    def champion(self) -> dict[str, Any] | None:
        found = self.mlflow.alias_version(self.model_name, CHAMPION)
        return None if found is None else version_record(found)

    def version(self, version: int) -> dict[str, Any] | None:
        found = self.mlflow.model_version(self.model_name, version)
        return None if found is None else version_record(found)

    # --- registering -----------------------------------------------------------------------------------------

    def register(self, export_dir: str, *, run_id: str, details: Mapping[str, Any]) -> dict[str, Any]:
        """The training run's export as a version (the ``challenger``), its files in ``v<N>-<sha12>/``; a retry
        returns the version it already made.

        :param run_id: the MLflow run that trained it (its ``model/`` artifacts are the version's source).
        :param details: airflow_run_id, ds, train_ds, auc, log_loss, decision, reason (as tags).
        """
        export = Path(export_dir)
        missing = [name for name in EXPORT_FILES if not (export / name).is_file()]
        if missing:
            raise RegistryError(f"export {export} lacks {', '.join(missing)}: the training job did not finish "
                                "its export; rerun the training task (it resumes from its last checkpoint)")
        sha256 = file_sha256(export / MODEL_FILE)
        self.mlflow.create_registered_model(self.model_name, description="hybridflow's model of record: alias "
                                            "champion serves and scores, challenger is the newest trained model")
        made = [v for v in self.mlflow.search_model_versions(self.model_name, run_id=run_id)
                if version_record(v)["sha256"] == sha256]
        model_version = made[0] if made else self.mlflow.create_model_version(
            self.model_name, source=f"runs:/{run_id}/model", run_id=run_id,
            tags={TAG_SHA256: sha256, **version_tags(details)})
        number = int(model_version["version"])
        target = self._materialise(export, number, sha256)
        self.mlflow.set_model_version_tags(self.model_name, number, {TAG_MODEL_DIR: str(target)})
        self.mlflow.set_alias(self.model_name, CHALLENGER, number)
        return self.version(number)

    def _materialise(self, export: Path, version: int, sha256: str) -> Path:
        """``v<N>-<sha12>/`` with the export's files: copied once; one already there must hold the same model."""
        target = self.version_dir(version, sha256)
        if target.exists():
            if (target / MODEL_FILE).is_file() and file_sha256(target / MODEL_FILE) == sha256:
                return target
            raise RegistryError(f"{target} holds another model than its name says (version {version} of "
                                f"{self.model_name}, sha256 {sha256[:12]}...): move it away and retry")
        self.root.mkdir(parents=True, exist_ok=True)
        with staged_dir(target, replace=False) as staging:
            for name in EXPORT_FILES:
                shutil.copy2(export / name, staging / name)
            os.chmod(staging, 0o755)
        return target

    # --- the champion ---------------------------------------------------------------------------------------

    @contextmanager
    def _promotion_lock(self, holder: str, wait_s: float) -> Iterator[None]:
        lock = f"{self.model_name}{LOCK_SUFFIX}"
        deadline = time.monotonic() + wait_s
        while not self.mlflow.create_registered_model(lock, tags={"holder": holder}, description=(
                "held while one promotion of the champion alias runs; delete it only if no promotion runs")):
            held = self.mlflow.registered_model(lock) or {}
            age_s = time.time() - int(held.get("creation_timestamp") or 0) / 1000
            if held and age_s > LOCK_STALE_S:
                self.mlflow.delete_registered_model(lock)  # left by a killed task
                continue
            if time.monotonic() > deadline:
                raise RegistryError(f"registered model {lock!r} (the promotion lock of {self.model_name}) is held "
                                    f"for {age_s:.0f} s; another promotion runs. Retry; delete it in MLflow only if "
                                    "none runs")
            time.sleep(0.5)
        try:
            yield
        finally:
            self.mlflow.delete_registered_model(lock)

    def promote(self, version: int, *, expected_champion: int | None, reason: str, holder: str = "",
                wait_s: float = 120) -> Promotion:
        """Move ``champion`` to ``version`` if it still points at ``expected_champion`` (the version the decision
        compared against); otherwise leave it and say who moved it. Idempotent: a version that is the champion
        already is reported promoted."""
        with self._promotion_lock(holder or f"v{version}", wait_s):
            current = self.champion()
            current_version = None if current is None else current["version"]
            if current_version == version:
                return Promotion(True, version, f"v{version} is the champion already")
            if current_version != expected_champion:
                message = (f"not promoted: the champion moved to v{current_version} while this run compared v{version} "
                           f"against {'no champion' if expected_champion is None else f'v{expected_champion}'}; the "
                           "next nightly run compares against the new champion")
                self.mlflow.set_model_version_tags(self.model_name, version, {"hybridflow.promotion": message})
                return Promotion(False, current_version, message)
            self.mlflow.set_model_version_tags(self.model_name, version, {
                TAG_PREVIOUS_CHAMPION: "" if expected_champion is None else str(expected_champion),
                "hybridflow.promotion_reason": clip(reason),
                "hybridflow.promoted_at": utc_now()})
            self.mlflow.set_alias(self.model_name, CHAMPION, version)
        return Promotion(True, version, reason)

    def roll_back(self, *, to_version: int | None = None, reason: str, holder: str = "") -> Promotion:
        """Move ``champion`` back: to ``to_version``, or to the version it replaced."""
        with self._promotion_lock(holder or "rollback", 120):
            current = self.champion()
            if current is None:
                raise RegistryError(f"{self.model_name} has no champion to roll back from")
            target = to_version or current["previous_champion"]
            if target is None:
                raise RegistryError(f"v{current['version']} of {self.model_name} replaced no earlier champion; name "
                                    "the version to restore")
            if target == current["version"]:
                return Promotion(True, target, f"v{target} is the champion already")
            if self.version(target) is None:
                raise RegistryError(f"{self.model_name} has no version {target}")
            self.mlflow.set_model_version_tags(self.model_name, current["version"], {
                TAG_ROLLED_BACK: clip(f"{utc_now()}: {reason}")})
            self.mlflow.set_alias(self.model_name, CHAMPION, target)
        return Promotion(True, target, reason)

    # --- what happened to a version after it was registered -----------------------------------------------------

    def record_deploy(self, version: int, report: Mapping[str, Any]) -> dict[str, str]:
        """Tag the version a deploy served or tried (the Triton record names it back, ``model_uri``)."""
        tags = deploy_tags(report, utc_now())
        self.mlflow.set_model_version_tags(self.model_name, version, tags)
        return tags

    def record_scoring(self, version: int, ds: str, rows: Any, airflow_run_id: str) -> dict[str, str]:
        tags = scoring_tags(ds, rows, airflow_run_id)
        self.mlflow.set_model_version_tags(self.model_name, version, tags)
        return tags

    def record_triton_rollback(self, rolled: Mapping[str, Any], holder: str = "") -> str:
        """After an on-call rollback of Triton, move ``champion`` to the registry version the restored Triton
        version serves (its record's ``model_uri``), so scoring and the next deploy follow it. A Triton version
        deployed outside the pipeline (no model_uri) or serving another registered model moves nothing; says why."""
        uri = rolled.get("model_uri") or ""
        where = f"Triton {rolled.get('model')} version {rolled.get('version')}"
        if not uri:
            return f"champion not moved: {where} names no registry version (it was deployed outside the pipeline)"
        name, version = parse_version_uri(uri, f"{where} model_uri")
        if name != self.model_name:
            return f"champion not moved: {where} serves {uri}, not a version of {self.model_name}"
        if self.version(version) is None:
            raise RegistryError(f"{where} names {uri}, which MLflow does not have: restore that version in MLflow "
                                f"or move alias {CHAMPION} by hand")
        outcome = self.roll_back(to_version=version, holder=holder or "oncall_rollback_model",
                                 reason=f"on-call rollback of {where} (from version {rolled.get('rolled_back_from')})")
        return f"champion is {uri} ({outcome.message})"


# --- importing the earlier file registry -------------------------------------------------------------------------

def import_json_registry(registry: ModelRegistry, path: Path) -> dict[str, Any]:
    """Every version of a file registry (``registry.json``) as an MLflow version, in version order, each with a
    run of its own in experiment ``model_registry_import`` holding its files; its champion as ``champion``. Runs
    again without duplicates; the file is renamed ``registry.json.imported`` once all went in."""
    data = json.loads(path.read_text())
    history = sorted(data.get("history") or [], key=lambda record: int(record["version"]))
    mlflow = registry.mlflow
    mlflow.create_registered_model(registry.model_name)
    imported = {version_record(v)["tags"].get(TAG_IMPORTED_FROM): int(v["version"])
                for v in mlflow.search_model_versions(registry.model_name)}
    experiment_id = mlflow.experiment_id(IMPORT_EXPERIMENT)
    mapping: dict[int, int] = {}
    previous: int | None = None
    for record in history:
        old = int(record["version"])
        if str(old) not in imported:
            key = hashlib.sha256(f"{registry.model_name}/{old}".encode()).hexdigest()[:32]
            run = mlflow.find_run_by_tag(experiment_id, "hybridflow.import_key", key) or mlflow.create_run(
                experiment_id, f"{registry.model_name}-v{old}-import",
                {"hybridflow.import_key": key, "hybridflow.airflow_run_id": str(record.get("run_id") or "")},
                int(time.time() * 1000))
            model_dir = Path(record["export_dir"])
            for name in EXPORT_FILES:
                mlflow.upload_artifact(run["info"]["artifact_uri"], f"model/{name}", (model_dir / name).read_bytes())
            mlflow.finish_run(run["info"]["run_id"], "FINISHED", int(time.time() * 1000))
            tags = {TAG_IMPORTED_FROM: str(old), TAG_MODEL_DIR: str(model_dir),
                    TAG_SHA256: record.get("sha256") or file_sha256(model_dir / MODEL_FILE),
                    TAG_PREVIOUS_CHAMPION: "" if previous is None else str(previous),
                    **version_tags({**record, "airflow_run_id": record.get("run_id")})}
            made = mlflow.create_model_version(
                registry.model_name, source=f"runs:/{run['info']['run_id']}/model", run_id=run["info"]["run_id"],
                tags=tags, description=f"imported from {path} (version {old})")
            imported[str(old)] = int(made["version"])
        mapping[old] = imported[str(old)]
        previous = mapping[old]  # every record of the file registry was a promotion, in this order
    champion = (data.get("champion") or {}).get("version")
    if champion is not None and registry.champion() is None:
        mlflow.set_alias(registry.model_name, CHAMPION, mapping[int(champion)])
    done = path.with_name(path.name + ".imported")
    path.rename(done)
    return {"model": registry.model_name, "versions": mapping, "champion": registry.champion()["version"]
            if champion is not None else None, "file": str(done)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from hybridflow.config import pipeline_config
    from hybridflow.hooks.mlflow import MlflowHook

    parser = argparse.ArgumentParser(prog="python -m hybridflow.pipeline.registry")
    parser.add_argument("command", choices=["import-json"])
    parser.parse_args(argv)
    config = pipeline_config()
    registry = ModelRegistry(MlflowHook(), config.storage.root, config.nightly.model_name)
    path = Path(registry.layout.legacy_model_registry(config.nightly.model_name))
    if not path.is_file():
        print(f"nothing to import: {path} does not exist (imported already, or never written)")
        return 0
    print(json.dumps(import_json_registry(registry, path), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
