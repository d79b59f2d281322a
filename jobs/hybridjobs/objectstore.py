"""Storage URIs for the cluster's jobs (no Airflow): a local path or ``s3://bucket/key``, opened through pyarrow's
filesystem layer, and a dataset partition's commit protocol that holds on an object store.

Object stores have no rename, so a partition cannot be swapped into place as on POSIX (atomic.py). Instead:

1. every writer (a job, and each Spark task of it) puts its parts under the job's attempt,
   ``<partition>/_attempt=<id>/part-<n>-<try>.parquet`` (``<try>``: a retried Spark task's number, so a killed
   try's part is never the one a retry names): a name no reader takes, since readers follow the manifest (and
   Spark and pyarrow skip ``_``-names when they list);
2. the committer removes ``_SUCCESS`` (from here the partition reads "not published"), writes ``_MANIFEST.json``
   naming every part (key relative to the partition, bytes, sha256, rows), then ``_SUCCESS`` holding the
   manifest's sha256;
3. then deletes every object the manifest does not name: earlier attempts, a killed writer's or task's parts.

A reader takes ``_SUCCESS``, then the manifest, and trusts the manifest only when its sha256 is the one
``_SUCCESS`` names (a commit in progress reads "not published", never half of two attempts); each part it reads is
checked against its size and sha256. A writer killed before step 2 leaves parts no manifest names: invisible, and
removed by the next commit.

A partition may hold several tables (raw: ``events`` and ``labels``): each part then names its ``table`` (its key
lies under ``_attempt=<id>/<table>/``) and the manifest holds each table's schema. A POSIX partition published by
renaming a staging folder into place (storage.py) carries the same manifest: its parts are the files Spark wrote
(:func:`file_part`), so one reader serves both roots.

Credentials: the standard AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, ``AWS_REGION``), else the file ``HYBRIDFLOW_S3_CREDENTIALS_FILE``
names (JSON, mode 0600, written by the operator and removed after the job), else pyarrow's own chain (instance
profile, ``~/.aws``). Keys never appear in a repr, an error or a log line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

CREDENTIALS_ENV = "HYBRIDFLOW_S3_CREDENTIALS_FILE"
MANIFEST_NAME = "_MANIFEST.json"
SUCCESS_NAME = "_SUCCESS"
ATTEMPT_PREFIX = "_attempt="
PROTOCOL = "manifest-v1"
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0
RETRIES = 3
HASH_CHUNK_BYTES = 8 << 20


class StorageError(RuntimeError):
    """A URI that cannot be opened, read or written; the message names the URI and what to do."""


class PartitionNotPublished(StorageError):
    """No ``_SUCCESS``, or a commit in progress: the partition's writer has not finished."""


class CorruptPart(StorageError):
    """A part whose bytes are not those its manifest names (size or sha256)."""


@dataclass(frozen=True)
class S3Access:
    """How to reach an S3-compatible store. The keys stay out of ``repr``."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> S3Access:
        """The AWS environment, else the 0600 credentials file ``HYBRIDFLOW_S3_CREDENTIALS_FILE`` names."""
        found = cls(endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
                    region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                    access_key=env.get("AWS_ACCESS_KEY_ID") or None,
                    secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
                    session_token=env.get("AWS_SESSION_TOKEN") or None)
        if found.access_key or not env.get(CREDENTIALS_ENV):
            return found
        return cls.from_file(Path(env[CREDENTIALS_ENV]))

    @classmethod
    def from_file(cls, path: Path) -> S3Access:
        """JSON with ``access_key_id``, ``secret_access_key`` and optionally ``session_token``, ``endpoint_url``,
        ``region``; refused unless only its owner may read it."""
        try:
            mode = path.stat().st_mode
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise StorageError(f"{CREDENTIALS_ENV}={path}: cannot read it ({type(error).__name__}); the operator "
                               f"writes it before the job starts") from None
        if stat.S_IMODE(mode) & 0o077:
            raise StorageError(f"{CREDENTIALS_ENV}={path}: mode {stat.S_IMODE(mode):04o} lets others read the keys; "
                               f"it must be 0600")
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and data[k]
                                                 for k in ("access_key_id", "secret_access_key")):
            raise StorageError(f"{CREDENTIALS_ENV}={path}: expected a JSON object with access_key_id and "
                               f"secret_access_key")
        return cls(endpoint_url=data.get("endpoint_url") or None, region=data.get("region") or None,
                   access_key=data["access_key_id"], secret_key=data["secret_access_key"],
                   session_token=data.get("session_token") or None)

    def filesystem(self) -> pafs.S3FileSystem:
        # An endpoint that does not answer fails the stage in seconds, not after the SDK's minutes of retries.
        options: dict[str, Any] = {"region": self.region or "us-east-1", "connect_timeout": CONNECT_TIMEOUT_S,
                                   "request_timeout": REQUEST_TIMEOUT_S,
                                   "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=RETRIES)}
        if self.access_key:
            options.update(access_key=self.access_key, secret_key=self.secret_key,
                           session_token=self.session_token)
        if self.endpoint_url:
            endpoint = urlsplit(self.endpoint_url)
            if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
                raise StorageError(f"S3 endpoint {self.endpoint_url!r}: expected http(s)://host[:port]")
            options.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
        return pafs.S3FileSystem(**options)


@dataclass(frozen=True)
class Location:
    """One URI opened: the filesystem and the path in it (``bucket/key`` on S3, absolute on POSIX)."""

    uri: str
    filesystem: pafs.FileSystem
    path: str

    def child(self, *names: str) -> Location:
        suffix = "/".join(names)
        return Location(f"{self.uri.rstrip('/')}/{suffix}", self.filesystem, f"{self.path.rstrip('/')}/{suffix}")

    @property
    def is_object_store(self) -> bool:
        return not isinstance(self.filesystem, pafs.LocalFileSystem)

    def read_bytes(self) -> bytes:
        try:
            with self.filesystem.open_input_stream(self.path) as stream:
                return stream.read()
        except FileNotFoundError:
            raise
        except OSError as error:
            raise StorageError(f"{self.uri}: cannot read it: {error}") from None

    def write_bytes(self, data: bytes) -> None:
        """One object (S3: one PUT, whole or not at all); on POSIX the parent folders are made first."""
        try:
            if not self.is_object_store:
                self.filesystem.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
            with self.filesystem.open_output_stream(self.path) as stream:
                stream.write(data)
        except OSError as error:
            raise StorageError(f"{self.uri}: cannot write it: {error}") from None

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.path).type != pafs.FileType.NotFound

    def delete(self) -> None:
        try:
            self.filesystem.delete_file(self.path)
        except FileNotFoundError:
            pass


def open_uri(uri: str, access: S3Access | None = None) -> Location:
    """A local path (or ``file://``) or ``s3://bucket/key``; anything else is refused naming the two."""
    if uri.startswith("s3://"):
        bucket_and_key = uri.removeprefix("s3://").rstrip("/")
        if not bucket_and_key or bucket_and_key.startswith("/"):
            raise StorageError(f"{uri!r}: expected s3://bucket/prefix")
        return Location(uri, (access or S3Access.from_environment()).filesystem(), bucket_and_key)
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(f"{uri!r}: unsupported scheme; use a local path or s3://bucket/prefix")
    path = uri.removeprefix("file://")
    if not path.startswith("/"):
        raise StorageError(f"{uri!r}: a local storage root must be an absolute path")
    return Location(uri, pafs.LocalFileSystem(), path.rstrip("/") or "/")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- partitions -------------------------------------------------------------------------------------------------


def new_attempt() -> str:
    """One writer's attempt id: every part it writes lies under ``_attempt=<id>/``."""
    return uuid.uuid4().hex[:16]


def write_part(partition: Location, attempt: str, index: int, table: pa.Table, task_try: int = 0,
               table_name: str | None = None) -> dict[str, Any]:
    """``table`` as one Parquet part of ``attempt`` (``task_try``: the try of the task writing part ``index``;
    ``table_name``: which of the partition's tables it belongs to, if it has several); its manifest entry (key
    relative to the partition). Whole in memory: one part is one Spark task's rows."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    key = part_key(attempt, index, task_try, table_name)
    partition.child(key).write_bytes(data)
    return part_entry(key, data, table.num_rows, table_name)


def part_key(attempt: str, index: int, task_try: int = 0, table_name: str | None = None) -> str:
    """Where part ``index`` of ``attempt`` lies in its partition (its table's folder, if named)."""
    folder = f"{ATTEMPT_PREFIX}{attempt}/{table_name}/" if table_name else f"{ATTEMPT_PREFIX}{attempt}/"
    return f"{folder}part-{index:05d}-{task_try}.parquet"


def part_entry(key: str, data: bytes, rows: int, table_name: str | None = None) -> dict[str, Any]:
    entry = {"key": key, "bytes": len(data), "sha256": sha256_hex(data), "rows": rows}
    return {**entry, "table": table_name} if table_name else entry


def file_part(partition: Location, key: str, table_name: str | None = None) -> dict[str, Any]:
    """The manifest entry of a Parquet file already in the partition (written by Spark's own writer), hashed as it
    streams (a file of any size) and its rows read from the footer."""
    location = partition.child(key)
    digest, size = hashlib.sha256(), 0
    try:
        with location.filesystem.open_input_stream(location.path) as stream:
            while chunk := stream.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
        with location.filesystem.open_input_file(location.path) as file:
            rows = pq.ParquetFile(file).metadata.num_rows
    except (OSError, pa.ArrowInvalid) as error:
        raise StorageError(f"{location.uri}: cannot read it as Parquet: {error}") from None
    entry = {"key": key, "bytes": size, "sha256": digest.hexdigest(), "rows": rows}
    return {**entry, "table": table_name} if table_name else entry


def parts_of(manifest: Mapping[str, Any], table_name: str | None = None) -> list[dict[str, Any]]:
    """The manifest's parts, or those of one of its tables."""
    return [part for part in manifest["parts"] if table_name is None or part.get("table") == table_name]


def success_body(manifest_body: bytes) -> bytes:
    """What ``_SUCCESS`` holds: the sha256 of the manifest it publishes."""
    return json.dumps({"manifest_sha256": sha256_hex(manifest_body)}).encode()


def commit_partition(partition: Location, parts: Iterable[Mapping[str, Any]],
                     fields: Mapping[str, Any] | None = None,
                     schema: pa.Schema | Mapping[str, pa.Schema] | None = None) -> dict[str, Any]:
    """Publishes ``parts`` (what :func:`write_part` returned) as the partition: ``_SUCCESS`` out, the manifest
    in, ``_SUCCESS`` in naming the manifest's sha256, then every object the manifest does not name deleted.
    ``fields``: the dataset's own manifest fields (row counts, columns, quality figures; ``row_count`` defaults to
    the parts' rows); ``schema``: the parts' (:func:`manifest_schema` reads it back, for a partition with no part
    too), or each table's by name. Returns the manifest."""
    manifest = manifest_fields(parts, fields, schema)
    body = json.dumps(manifest, indent=2, sort_keys=True).encode()
    partition.child(SUCCESS_NAME).delete()
    partition.child(MANIFEST_NAME).write_bytes(body)
    partition.child(SUCCESS_NAME).write_bytes(success_body(body))
    _delete_unnamed(partition, {part["key"] for part in parts} | {MANIFEST_NAME, SUCCESS_NAME})
    return manifest


def manifest_fields(parts: Iterable[Mapping[str, Any]], fields: Mapping[str, Any] | None = None,
                    schema: pa.Schema | Mapping[str, pa.Schema] | None = None) -> dict[str, Any]:
    """The manifest of ``parts``: the dataset's ``fields``, the protocol, the parts in key order, the schema."""
    parts = sorted((dict(part) for part in parts), key=lambda part: part["key"])
    manifest = {"row_count": sum(part["rows"] for part in parts), **(fields or {}), "protocol": PROTOCOL,
                "parts": parts}
    if isinstance(schema, pa.Schema):
        manifest["schema"] = schema_text(schema)
    elif schema is not None:
        manifest["schemas"] = {name: schema_text(each) for name, each in schema.items()}
    return manifest


def read_manifest(partition: Location) -> dict[str, Any]:
    """The published manifest, bound to ``_SUCCESS``.

    :raises PartitionNotPublished: no ``_SUCCESS`` (not written, or a commit in progress), or a manifest other
        than the one ``_SUCCESS`` names (a commit in progress).
    """
    try:
        success = partition.child(SUCCESS_NAME).read_bytes()
        body = partition.child(MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        _check_bucket(partition)
        raise PartitionNotPublished(f"{partition.uri}: not published (no {SUCCESS_NAME}); its writer has not "
                                    f"finished, or never ran") from None
    try:
        expected = json.loads(success)["manifest_sha256"]
        manifest = json.loads(body)
    except (ValueError, KeyError, TypeError):
        raise StorageError(f"{partition.uri}: {SUCCESS_NAME} or {MANIFEST_NAME} is not what the {PROTOCOL} "
                           f"protocol writes; rerun the stage that writes the partition") from None
    if sha256_hex(body) != expected:
        raise PartitionNotPublished(f"{partition.uri}: a commit is in progress ({MANIFEST_NAME} is not the one "
                                    f"{SUCCESS_NAME} names); read it again once its writer finished")
    return manifest


def _check_bucket(location: Location) -> None:
    """An object store answers "no such key" for a missing bucket too: say which it is. Keys that may not ask
    about the bucket itself (no s3:ListBucket) leave the answer at "not published"."""
    if not location.is_object_store:
        return
    bucket = location.path.split("/", 1)[0]
    try:
        found = location.filesystem.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError:
        return
    if not found:
        raise StorageError(f"{location.uri}: bucket {bucket} does not exist, or these credentials cannot see it: "
                           f"create it, or point the storage root at one that exists")


def read_part(partition: Location, part: Mapping[str, Any], columns: list[str] | None = None) -> pa.Table:
    """One part, its bytes checked against the manifest first."""
    try:
        data = partition.child(part["key"]).read_bytes()
    except FileNotFoundError:
        raise PartitionNotPublished(f"{partition.uri}: {part['key']} is gone (a rerun replaced the partition "
                                    f"while it was read); read it again") from None
    if len(data) != part["bytes"] or sha256_hex(data) != part["sha256"]:
        raise CorruptPart(f"{partition.uri}/{part['key']}: {len(data)} bytes with sha256 {sha256_hex(data)[:12]}, "
                          f"the manifest names {part['bytes']} bytes with {part['sha256'][:12]}; rerun the stage "
                          f"that writes the partition")
    return pq.read_table(pa.BufferReader(data), columns=columns)


def read_partition(partition: Location, columns: list[str] | None = None, table_name: str | None = None) -> pa.Table:
    """Every part the manifest names (of one table, if named), in its order, checked."""
    manifest = read_manifest(partition)
    tables = [read_part(partition, part, columns) for part in parts_of(manifest, table_name)]
    if tables:
        return pa.concat_tables(tables, promote_options="permissive")
    if "schema" not in manifest and "schemas" not in manifest:
        return pa.table({})  # committed with no schema: nothing says what its columns would be
    empty = manifest_schema(manifest, table_name).empty_table()
    return empty.select(columns) if columns else empty


def schema_text(schema: pa.Schema) -> str:
    """A table's schema as manifest text (Arrow IPC, base64): a reader of an empty partition still has its columns."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def manifest_schema(manifest: Mapping[str, Any], table_name: str | None = None) -> pa.Schema:
    """The schema of the partition's parts (``table_name``: of that table's)."""
    try:
        text = manifest["schemas"][table_name] if table_name else manifest["schema"]
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (KeyError, TypeError, ValueError, pa.ArrowInvalid):
        which = f" for table {table_name!r}" if table_name else ""
        raise StorageError(f"the manifest has no readable schema{which}; rerun the stage that writes the "
                           f"partition") from None


def _delete_unnamed(partition: Location, keys: set[str]) -> None:
    """Deletes every object under the partition whose key (relative to it) is not kept, and every folder that
    holds no kept key (POSIX; an object store has only keys)."""
    prefix = partition.path.rstrip("/") + "/"
    kept_folders = {key.rsplit("/", depth)[0] for key in keys for depth in range(1, key.count("/") + 1)}
    selector = pafs.FileSelector(partition.path, recursive=True, allow_not_found=True)
    for info in sorted(partition.filesystem.get_file_info(selector), key=lambda info: info.path):
        relative = info.path.removeprefix(prefix)
        try:
            if info.type == pafs.FileType.Directory and relative not in kept_folders:
                partition.filesystem.delete_dir(info.path)  # shallow first: a deleted folder's own entries go too
            elif info.type == pafs.FileType.File and relative not in keys:
                partition.filesystem.delete_file(info.path)
        except FileNotFoundError:
            pass  # inside a folder already deleted
