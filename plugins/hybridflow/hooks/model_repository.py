"""The Triton model repository the server serves from (a local directory or ``s3://bucket/prefix``), written so a
half-published version is never visible to the server.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.atomic import SwapError, staged_dir, write_bytes_atomic
from hybridflow.config import ServingConfig
from hybridflow.exceptions import TritonError
from hybridflow.utils.triton import CONFIG_FILE, RECORD_FILE, Repository, VersionRecord, version_numbers

if TYPE_CHECKING:
    from hybridflow.hooks.storage import StorageHook


class ModelRepository(ABC):
    """A Triton model repository: ``<root>/<model>/config.pbtxt`` and ``<root>/<model>/<version>/...``.

    A version becomes visible to the server in one step: locally its directory is written under a staging name
    and renamed into place; on S3 its objects are written first, its record last, and the config that names it
    in the version policy after that. The server is only ever told to load versions the config names.
    """

    def __init__(self, repository: Repository):
        self.repository = repository

    @property
    def uri(self) -> str:
        return self.repository.uri

    @abstractmethod
    def versions(self, name: str) -> list[int]:
        """Every version directory of the model, complete or not (numbering never reuses one)."""

    @abstractmethod
    def read(self, name: str, relpath: str) -> bytes | None:
        """A file of the model directory, or None."""

    @abstractmethod
    def write(self, name: str, relpath: str, data: bytes) -> None:
        """Replace one file of the model directory in one step."""

    @abstractmethod
    def publish_version(self, name: str, version: int, files: Mapping[str, Path | bytes],
                        record: VersionRecord) -> None:
        """Write a whole version; it is visible only once complete. An existing version is never overwritten."""

    @abstractmethod
    def remove_model(self, name: str) -> None:
        """Delete the model directory (tests, retired models)."""

    def records(self, name: str) -> dict[int, VersionRecord]:
        """The records of the complete versions."""
        found = {}
        for version in self.versions(name):
            text = self.read(name, f"{version}/{RECORD_FILE}")
            if text is not None:
                found[version] = VersionRecord.from_json(text.decode())
        return found

    def write_record(self, name: str, record: VersionRecord) -> None:
        self.write(name, f"{record.version}/{RECORD_FILE}", record.to_json().encode())

    def write_config(self, name: str, text: str) -> bool:
        """Replace the model's config; an identical one is left alone (a rewrite would make the server reload
        every version on the next load). Returns whether it changed."""
        if self.read_config(name) == text:
            return False
        self.write(name, CONFIG_FILE, text.encode())
        return True

    def read_config(self, name: str) -> str | None:
        data = self.read(name, CONFIG_FILE)
        return data.decode() if data is not None else None


class LocalModelRepository(ModelRepository):
    """A directory the server reads (``--model-repository``). Staging lives in ``<root>/.staging`` on the same
    filesystem, outside every model directory, so a rename publishes it whole."""

    @property
    def root(self) -> Path:
        return Path(self.repository.location)

    def _staging(self) -> Path:
        path = self.root / ".staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _drop_staging(self) -> None:
        """The server lists every directory of the repository in its index: leave none behind."""
        try:
            (self.root / ".staging").rmdir()
        except OSError:
            pass  # another publish is using it

    def versions(self, name: str) -> list[int]:
        model_dir = self.root / name
        return version_numbers(p.name for p in model_dir.iterdir() if p.is_dir()) if model_dir.is_dir() else []

    def read(self, name: str, relpath: str) -> bytes | None:
        path = self.root / name / relpath
        return path.read_bytes() if path.is_file() else None

    def write(self, name: str, relpath: str, data: bytes) -> None:
        target = self.root / name / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_bytes_atomic(target, data, mode=0o644, temp_dir=self._staging())
        finally:
            self._drop_staging()

    def publish_version(self, name: str, version: int, files: Mapping[str, Path | bytes],
                        record: VersionRecord) -> None:
        try:
            # replace=False: rename(2) refuses a non-empty target, so a concurrent deploy cannot overwrite a
            # published version.
            # 0o775, as the shared storage: whoever of its group promotes or rolls back rewrites the record here.
            with staged_dir(self.root / name / str(version), replace=False, staging_parent=self._staging(),
                            mode=0o775) as staging:
                for relpath, content in files.items():
                    target = staging / relpath
                    if isinstance(content, bytes):
                        target.write_bytes(content)
                    else:
                        shutil.copyfile(content, target)
                    target.chmod(0o644)
                (staging / RECORD_FILE).write_text(record.to_json())
        except SwapError as exc:
            raise TritonError(
                f"cannot publish version {version} of {name} in {self.root}: {exc}; another deploy of the same "
                "model may be running: let it finish, then rerun"
            ) from exc
        finally:
            self._drop_staging()

    def remove_model(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)


class S3ModelRepository(ModelRepository):
    """``s3://bucket/prefix`` through the storage connection (a server started with that S3 repository reads it)."""

    def __init__(self, repository: Repository, storage: StorageHook):
        super().__init__(repository)
        self.storage = storage

    @property
    def bucket(self) -> str:
        return self.repository.location

    def key(self, name: str, relpath: str = "") -> str:
        parts = [p for p in (self.repository.prefix, name, relpath) if p]
        return "/".join(parts)

    def versions(self, name: str) -> list[int]:
        return version_numbers(self.storage.list_prefixes(self.bucket, self.key(name)))

    def read(self, name: str, relpath: str) -> bytes | None:
        client = self.storage.client
        try:
            return client.get_object(Bucket=self.bucket, Key=self.key(name, relpath))["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    def write(self, name: str, relpath: str, data: bytes) -> None:
        self.storage.client.put_object(Bucket=self.bucket, Key=self.key(name, relpath), Body=data)

    def publish_version(self, name: str, version: int, files: Mapping[str, Path | bytes],
                        record: VersionRecord) -> None:
        if self.read(name, f"{version}/{RECORD_FILE}") is not None:
            raise TritonError(f"version {version} of {name} already exists in {self.uri}; another deploy of the same "
                              "model may be running: let it finish, then rerun")
        for relpath, content in files.items():
            key = self.key(name, f"{version}/{relpath}")
            if isinstance(content, bytes):
                self.storage.client.put_object(Bucket=self.bucket, Key=key, Body=content)
            else:
                self.storage.upload_file(str(content), self.bucket, key)
        self.write_record(name, record)

    def remove_model(self, name: str) -> None:
        keys = [key for key, _ in self.storage.list_keys(self.bucket, self.key(name) + "/")]
        for start in range(0, len(keys), 1000):
            self.storage.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})


def open_repository(uri: str, storage_conn_id: str = ServingConfig.storage_conn_id) -> ModelRepository:
    """The repository at ``uri``: a local directory, or ``s3://bucket/prefix`` through ``storage_conn_id``."""
    repository = Repository.parse(uri)
    if repository.scheme == "s3":
        from hybridflow.hooks.storage import StorageHook

        return S3ModelRepository(repository, StorageHook(storage_conn_id))
    return LocalModelRepository(repository)
