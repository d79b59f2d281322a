"""The model of record: numbered model versions and ``registry.json`` on the shared storage.

``<root>/models/<name>/v<N>/`` holds a promoted export (model.pt, signature.json, smoke.json, promotion.json);
``<root>/models/<name>/registry.json`` names the champion and keeps the history. A version directory is copied
under a temporary name and renamed into place, and the registry is replaced atomically after it, so a reader
sees the previous champion or the new one, never a half-copied model. Promoting the same export of the same run
twice (a retried task) returns the version it already made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.atomic import staged_dir, write_json_atomic
from hybridflow.exceptions import HybridflowError
from hybridflow.layout import StorageLayout

EXPORT_FILES = ("model.pt", "signature.json", "smoke.json")


class RegistryError(HybridflowError):
    """The registry or an export is missing or inconsistent; the message names the path."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ModelRegistry:
    def __init__(self, storage_root: str, model_name: str):
        self.model_name = model_name
        self.layout = StorageLayout(storage_root)
        self.root = Path(self.layout.model_dir(model_name))
        self.registry_path = Path(self.layout.model_registry(model_name))

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.registry_path.read_text())
        except FileNotFoundError:
            return {"model_name": self.model_name, "champion": None, "history": []}
        except (OSError, json.JSONDecodeError) as error:
            raise RegistryError(f"{self.registry_path} cannot be read ({error}); restore it from the history in "
                                "the version directories' promotion.json (runbook: include/runbooks/evaluation.md)"
                                ) from None

    def champion(self) -> dict[str, Any] | None:
        return self.read()["champion"]

    def version_dir(self, version: int) -> Path:
        return Path(self.layout.model_version_dir(self.model_name, version))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def promote(self, export_dir: str, details: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``export_dir`` in as the next version and make it the champion.

        :param details: what the record keeps besides paths: run_id, ds, holdout metrics, decision, reason.
        """
        export = Path(export_dir)
        missing = [name for name in EXPORT_FILES if not (export / name).is_file()]
        if missing:
            raise RegistryError(f"export {export} lacks {', '.join(missing)}: the training job did not finish "
                                "its export; rerun the training task (it resumes from its last checkpoint)")
        sha256 = file_sha256(export / "model.pt")
        with self._locked():
            registry = self.read()
            for record in registry["history"]:
                if record["sha256"] == sha256 and record.get("run_id") == details.get("run_id"):
                    return record  # a retry of a promotion that already happened
            version = 1 + max((r["version"] for r in registry["history"]), default=0)
            target = self.version_dir(version)
            record = {
                **details,
                "version": version,
                "model_path": str(target / "model.pt"),
                "export_dir": str(target),
                "source_export": str(export),
                "sha256": sha256,
                "promoted_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            with staged_dir(target, replace=False) as staging:  # a version directory is never overwritten
                shutil.copytree(export, staging, dirs_exist_ok=True)
                (staging / "promotion.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
                os.chmod(staging, 0o755)
            registry["champion"] = record
            registry["history"].append(record)
            self._write(registry)
            return record

    def _write(self, registry: Mapping[str, Any]) -> None:
        write_json_atomic(self.registry_path, registry, sort_keys=True)
