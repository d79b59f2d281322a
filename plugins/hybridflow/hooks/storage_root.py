"""The storage root as Airflow's side reads and writes it: the published dataset partitions (raw, features,
quarantine, predictions) and the run reports, through Airflow's ``ObjectStoragePath``, so one code path serves a
local root and ``s3://`` (the Amazon provider's ``aws`` connection brings keys, role assumption, profiles and
``endpoint_url``). The jobs' processes get the same access in their environment (:meth:`StorageRoot.job_environment`).

A partition is published when ``_SUCCESS`` is there; when ``_SUCCESS`` names its manifest's sha256 (the jobs'
``manifest-v1`` protocol, jobs/hybridjobs/objectstore.py), only that manifest counts: an object store has no
atomic rename, so a manifest that ``_SUCCESS`` does not name belongs to a commit still in progress. An empty
``_SUCCESS`` (partitions published by a rename before the protocol) is taken as it is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.exceptions import HybridflowError
from hybridflow.layout import StorageLayout

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

SUCCESS_NAME = "_SUCCESS"
MANIFEST_NAME = "_MANIFEST.json"


class StorageUnreachableError(HybridflowError):
    """The storage root cannot be read: a missing bucket, refused keys, an unreachable endpoint."""


def storage_errors() -> tuple[type[Exception], ...]:
    """What reading the root raises when it is unreachable: OSError (s3fs maps refused keys to PermissionError),
    and botocore's own errors, which s3fs lets through (an endpoint that does not answer)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # a local root needs no botocore
        return (OSError,)
    return (OSError, BotoCoreError, ClientError)


def storage_path(uri: str, conn_id: str | None = None) -> ObjectStoragePath:
    """``uri`` (a local path or ``s3://bucket/key``) as an ObjectStoragePath; ``conn_id`` is used for s3:// only."""
    from airflow.sdk import ObjectStoragePath

    return ObjectStoragePath(uri, conn_id=conn_id if uri.startswith("s3://") else None)


def published_manifest(success: bytes, manifest: bytes) -> dict[str, Any] | None:
    """The manifest a partition publishes, from the bytes of its ``_SUCCESS`` and ``_MANIFEST.json``; None while a
    commit is in progress (``_SUCCESS`` names another manifest). Pure: the rule, apart from the I/O."""
    if success.strip():
        try:
            named = json.loads(success)["manifest_sha256"]
        except (ValueError, KeyError, TypeError):
            raise HybridflowError(f"{SUCCESS_NAME} holds {success[:80]!r}, not what the manifest-v1 protocol writes; "
                                  f"rerun the stage that writes the partition") from None
        if hashlib.sha256(manifest).hexdigest() != named:
            return None
    try:
        found = json.loads(manifest)
    except ValueError as error:
        raise HybridflowError(f"{MANIFEST_NAME} is not JSON ({error}); rerun the stage that writes the partition") \
            from None
    if not isinstance(found, dict):
        raise HybridflowError(f"{MANIFEST_NAME} holds a {type(found).__name__}, not a JSON object; rerun the stage "
                              f"that writes the partition")
    return found


class StorageRoot:
    """What lies under ``root``; ``conn_id`` is the ``aws`` connection of an s3:// root."""

    def __init__(self, root: str, conn_id: str | None = None):
        self.root = root.rstrip("/")
        self.conn_id = conn_id
        self.layout = StorageLayout(self.root)

    def manifest(self, dataset: str, ds: str) -> dict[str, Any] | None:
        """The published manifest of ``dataset/ds=<ds>``; None when it is not published (yet)."""
        uri = self.layout.partition(dataset, ds)
        partition = storage_path(uri, self.conn_id)
        try:
            success = (partition / SUCCESS_NAME).read_bytes()
            body = (partition / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            self._check_bucket()
            return None
        except storage_errors() as error:
            raise self._unreachable(uri, error) from None
        try:
            return published_manifest(success, body)
        except HybridflowError as error:
            raise HybridflowError(f"{uri}: {error}") from None

    def is_published(self, dataset: str, ds: str) -> bool:
        return self.manifest(dataset, ds) is not None

    def published_manifests(self, dataset: str) -> dict[str, dict[str, Any]]:
        """The manifest of every published partition of ``dataset`` by ds, oldest first (ISO dates sort as
        strings): one read of each, so callers that need the days and their figures read nothing twice."""
        uri = self.layout.dataset(dataset)
        folder = storage_path(uri, self.conn_id)
        try:
            names = [child.name for child in folder.iterdir()] if folder.exists() else []
        except FileNotFoundError:
            names = []
        except storage_errors() as error:
            raise self._unreachable(uri, error) from None
        if not names:
            self._check_bucket()
        days = sorted(name.removeprefix("ds=") for name in names if name.startswith("ds="))
        found = {ds: self.manifest(dataset, ds) for ds in days}
        return {ds: manifest for ds, manifest in found.items() if manifest is not None}

    def published_ds(self, dataset: str) -> list[str]:
        """The ds of every published partition of ``dataset``, sorted."""
        return list(self.published_manifests(dataset))

    @property
    def on_object_store(self) -> bool:
        return self.root.startswith("s3://")

    def path(self, uri: str) -> ObjectStoragePath:
        """A path under this root (a layout URI) with this root's connection."""
        return storage_path(uri, self.conn_id)

    def publish_folder(self, local: Path, uri: str, last: str) -> list[str]:
        """Copies every file of the local folder ``local`` to ``uri`` (``last`` after all others, so a reader that
        finds it finds the rest), then deletes what an earlier copy left there that this one does not have: a
        rerun replaces the folder. Returns the URIs written."""
        target = self.path(uri)
        names = sorted((f.name for f in local.iterdir() if f.is_file()), key=lambda name: name == last)
        try:
            for name in names:
                (target / name).write_bytes((local / name).read_bytes())
            stale = [child for child in target.iterdir() if child.name not in names]
            for child in stale:
                child.unlink()
        except storage_errors() as error:
            raise self._unreachable(uri, error) from None
        return [f"{uri}/{name}" for name in names]

    def read_bytes(self, uri: str) -> bytes | None:
        """The object at ``uri``; None when there is none."""
        try:
            return self.path(uri).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None
        except storage_errors() as error:
            raise self._unreachable(uri, error) from None

    def _check_bucket(self) -> None:
        """An object store answers "not found" for a missing bucket too: say which it is, instead of waiting for a
        partition that can never appear."""
        if not self.on_object_store:
            return
        bucket = self.root.removeprefix("s3://").split("/", 1)[0]
        try:
            found = storage_path(f"s3://{bucket}", self.conn_id).exists()
        except storage_errors() as error:
            raise self._unreachable(f"s3://{bucket}", error) from None
        if not found:
            raise StorageUnreachableError(
                f"bucket {bucket} of the storage root {self.root} does not exist, or connection {self.conn_id!r} "
                f"cannot see it: create it, or point storage.root at one that exists")

    def _unreachable(self, uri: str, error: Exception) -> StorageUnreachableError:
        how = (f"check the bucket, and the keys and endpoint_url of connection {self.conn_id!r}" if
               self.on_object_store else "check that this worker mounts the storage root")
        return StorageUnreachableError(f"cannot read {uri}: {type(error).__name__}: {error}; {how}")

    def job_environment(self) -> dict[str, str]:
        """The standard AWS variables that give a job process (the raw generator, a Spark driver) this store's
        access, from the connection (role assumption and profiles resolved here); empty for a local root. Hand it
        over in the process's environment, never on its command line."""
        if not self.on_object_store:
            return {}
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        hook = S3Hook(aws_conn_id=self.conn_id)
        try:
            credentials = hook.get_credentials()
        except storage_errors() as error:
            raise self._unreachable(self.root, error) from None
        values = {
            "AWS_ACCESS_KEY_ID": credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
            "AWS_SESSION_TOKEN": credentials.token,
            "AWS_ENDPOINT_URL_S3": hook.conn_config.get_service_endpoint_url(service_name="s3"),
            "AWS_REGION": hook.conn_region_name,
        }
        return {name: value for name, value in values.items() if value}
