"""hybridjobs.objectstore: the partition commit protocol on a POSIX root and on an S3 endpoint (moto's server, the
S3-compatible endpoint that runs here, in this process on a port of its own), and the URIs and credentials it
accepts."""

from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pytest
from hybridjobs.objectstore import (
    MANIFEST_NAME,
    SUCCESS_NAME,
    CorruptPart,
    PartitionNotPublished,
    S3Access,
    StorageError,
    commit_partition,
    manifest_schema,
    new_attempt,
    open_uri,
    read_manifest,
    read_partition,
    write_part,
)

KEYS = {"AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret-key-9f3a"}


@pytest.fixture(params=["posix", "s3"])
def root(request, tmp_path):
    """A storage root URI and the access that opens it."""
    if request.param == "posix":
        return str(tmp_path / "storage"), None
    bucket, access = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/prefix", access


def partition_of(root) -> object:
    uri, access = root
    return open_uri(f"{uri}/features/ds=2026-07-17", access)


def table(start: int, rows: int) -> pa.Table:
    return pa.table({"customer_id": [f"c{i}" for i in range(start, start + rows)],
                     "amount": [float(i) for i in range(start, start + rows)]})


def names_under(partition) -> set[str]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(partition.path, recursive=True, allow_not_found=True)
    prefix = partition.path + "/"
    return {info.path.removeprefix(prefix) for info in partition.filesystem.get_file_info(selector)
            if info.type == pafs.FileType.File}


def publish(partition, *tables: pa.Table, fields=None) -> tuple[str, dict]:
    attempt = new_attempt()
    parts = [write_part(partition, attempt, index, t) for index, t in enumerate(tables)]
    return attempt, commit_partition(partition, parts, fields)


def test_a_committed_partition_reads_back_every_part_in_order_with_its_fields(root):
    partition = partition_of(root)
    attempt, manifest = publish(partition, table(0, 3), table(3, 2), fields={"dataset": "features"})
    assert manifest["row_count"] == 5 and manifest["dataset"] == "features" and manifest["protocol"] == "manifest-v1"
    assert [p["key"] for p in manifest["parts"]] == [f"_attempt={attempt}/part-00000-0.parquet",
                                                     f"_attempt={attempt}/part-00001-0.parquet"]
    assert read_manifest(partition) == manifest
    assert read_partition(partition).column("customer_id").to_pylist() == [f"c{i}" for i in range(5)]
    assert read_partition(partition, columns=["amount"]).column_names == ["amount"]
    assert names_under(partition) == {MANIFEST_NAME, SUCCESS_NAME, *(p["key"] for p in manifest["parts"])}


def test_nothing_written_and_a_writer_killed_before_its_commit_both_read_not_published(root):
    partition = partition_of(root)
    with pytest.raises(PartitionNotPublished, match=r"ds=2026-07-17: not published \(no _SUCCESS\)"):
        read_manifest(partition)
    write_part(partition, new_attempt(), 0, table(0, 3))  # parts, then the writer dies
    with pytest.raises(PartitionNotPublished, match="not published"):
        read_partition(partition)


def test_a_rerun_replaces_the_partition_and_removes_the_earlier_and_a_killed_writers_parts(root):
    partition = partition_of(root)
    first, _ = publish(partition, table(0, 3))
    write_part(partition, "killedwriter0001", 0, table(100, 7))  # a writer that never committed
    second, manifest = publish(partition, table(10, 2))
    assert read_partition(partition).column("customer_id").to_pylist() == ["c10", "c11"]
    left = names_under(partition)
    assert left == {MANIFEST_NAME, SUCCESS_NAME, f"_attempt={second}/part-00000-0.parquet"}
    assert not any(first in name or "killedwriter" in name for name in left)


def test_a_killed_task_try_beside_its_retry_is_removed_and_never_read(root):
    partition = partition_of(root)
    attempt = new_attempt()
    write_part(partition, attempt, 0, table(100, 7))  # try 0 of task 0 wrote its part, then its executor died
    retried = write_part(partition, attempt, 0, table(0, 3), task_try=1)
    manifest = commit_partition(partition, [retried, write_part(partition, attempt, 1, table(3, 2))])
    assert [p["key"] for p in manifest["parts"]] == [f"_attempt={attempt}/part-00000-1.parquet",
                                                     f"_attempt={attempt}/part-00001-0.parquet"]
    assert read_partition(partition).column("customer_id").to_pylist() == [f"c{i}" for i in range(5)]
    assert names_under(partition) == {MANIFEST_NAME, SUCCESS_NAME, *(p["key"] for p in manifest["parts"])}


def test_the_schema_in_the_manifest_gives_an_empty_partition_its_columns(root):
    partition = partition_of(root)
    manifest = commit_partition(partition, [], schema=table(0, 1).schema)
    assert manifest["row_count"] == 0 and manifest["parts"] == []
    assert manifest_schema(read_manifest(partition)) == table(0, 1).schema


def test_a_partition_of_two_tables_reads_each_with_its_own_schema_even_an_empty_one(root):
    partition = partition_of(root)
    attempt = new_attempt()
    labels = pa.table({"customer_id": ["c0", "c1"], "label": pa.array([1, 0], pa.int32())})
    parts = [write_part(partition, attempt, 0, table(0, 3), table_name="events"),
             write_part(partition, attempt, 1, table(3, 2), table_name="events"),
             write_part(partition, attempt, 0, labels, table_name="labels")]
    empty = pa.schema([("customer_id", pa.string()), ("reason", pa.string())])
    manifest = commit_partition(partition, parts, {"row_count": 5},
                                schema={"events": table(0, 1).schema, "labels": labels.schema, "notes": empty})
    assert manifest["row_count"] == 5  # the dataset's own count (its events), not every table's rows
    assert [p["key"] for p in manifest["parts"]] == [f"_attempt={attempt}/events/part-00000-0.parquet",
                                                     f"_attempt={attempt}/events/part-00001-0.parquet",
                                                     f"_attempt={attempt}/labels/part-00000-0.parquet"]
    assert read_partition(partition, table_name="events").column("customer_id").to_pylist() == [
        f"c{i}" for i in range(5)]
    assert read_partition(partition, table_name="labels").equals(labels)
    assert read_partition(partition, ["reason"], table_name="notes").schema == pa.schema([("reason", pa.string())])
    with pytest.raises(StorageError, match="no readable schema for table 'other'"):
        read_partition(partition, table_name="other")


@pytest.mark.parametrize("schema", [None, "", "not base64!", "aGVsbG8=", 7])
def test_a_manifest_without_a_readable_schema_says_to_rewrite_the_partition(schema):
    with pytest.raises(StorageError, match="no readable schema; rerun the stage"):
        manifest_schema({} if schema is None else {"schema": schema})


def test_a_commit_in_progress_reads_not_published_never_half_of_two_attempts(root):
    partition = partition_of(root)
    publish(partition, table(0, 3))
    # The committer has written the new manifest but not yet its _SUCCESS (killed there, or still on its way).
    partition.child(MANIFEST_NAME).write_bytes(json.dumps({"protocol": "manifest-v1", "parts": []}).encode())
    with pytest.raises(PartitionNotPublished, match="a commit is in progress"):
        read_partition(partition)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "replaced"])
def test_a_part_whose_bytes_differ_from_the_manifest_is_refused_naming_it(root, damage):
    partition = partition_of(root)
    _, manifest = publish(partition, table(0, 50))
    part = partition.child(manifest["parts"][0]["key"])
    data = part.read_bytes()
    part.write_bytes({"flipped": data[:100] + bytes([data[100] ^ 1]) + data[101:], "truncated": data[:-10],
                      "replaced": data[::-1]}[damage])
    with pytest.raises(CorruptPart, match=r"part-00000-0.parquet: \d+ bytes with sha256 .* the manifest names"):
        read_partition(partition)


@pytest.mark.parametrize("success, manifest", [
    (b"not json", None),
    (b'{"other": 1}', None),
    (None, b"not json"),
])
def test_markers_that_the_protocol_did_not_write_are_refused_with_the_fix(root, success, manifest):
    partition = partition_of(root)
    publish(partition, table(0, 3))
    if success is not None:
        partition.child(SUCCESS_NAME).write_bytes(success)
    if manifest is not None:
        partition.child(MANIFEST_NAME).write_bytes(manifest)
    with pytest.raises(StorageError, match="rerun the stage that writes the partition|a commit is in progress"):
        read_manifest(partition)


@pytest.mark.parametrize("uri, says", [
    ("gs://bucket/x", "unsupported scheme; use a local path or s3://bucket/prefix"),
    ("hdfs://nn/x", "unsupported scheme"),
    ("relative/storage", "a local storage root must be an absolute path"),
    ("", "a local storage root must be an absolute path"),
    ("s3://", "expected s3://bucket/prefix"),
    ("s3:///key", "expected s3://bucket/prefix"),
])
def test_uris_that_name_no_storage_are_refused(uri, says):
    with pytest.raises(StorageError, match=says):
        open_uri(uri, S3Access())


def test_an_endpoint_that_is_not_a_url_is_refused():
    with pytest.raises(StorageError, match=r"S3 endpoint 'localhost:9000': expected http\(s\)://host\[:port\]"):
        open_uri("s3://bucket/x", S3Access(endpoint_url="localhost:9000"))


def test_a_missing_bucket_names_the_uri(s3_endpoint):
    location = open_uri("s3://no-such-bucket-here/features/_MANIFEST.json",
                        S3Access.from_environment({**KEYS, "AWS_ENDPOINT_URL": s3_endpoint}))
    with pytest.raises((StorageError, FileNotFoundError, OSError), match="no-such-bucket-here"):
        location.read_bytes()


def test_reading_a_partition_in_a_missing_bucket_says_the_bucket_is_missing_not_unpublished(s3_endpoint):
    partition = open_uri("s3://no-such-bucket-here/features/ds=2026-07-17",
                         S3Access.from_environment({**KEYS, "AWS_ENDPOINT_URL": s3_endpoint}))
    with pytest.raises(StorageError, match="ds=2026-07-17: bucket no-such-bucket-here does not exist") as raised:
        read_manifest(partition)
    assert not isinstance(raised.value, PartitionNotPublished)


def test_an_endpoint_that_does_not_answer_fails_in_seconds_naming_the_uri():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    location = open_uri("s3://bucket/features/ds=2026-07-17/_SUCCESS",
                        S3Access.from_environment({**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}))
    with pytest.raises(StorageError, match=r"s3://bucket/features/ds=2026-07-17/_SUCCESS: cannot write it"):
        location.write_bytes(b"x")


def test_credentials_come_from_the_environment_first_and_never_show_in_a_repr(tmp_path):
    access = S3Access.from_environment({**KEYS, "AWS_ENDPOINT_URL_S3": "http://s3.local:9000",
                                        "AWS_ENDPOINT_URL": "http://other:1", "AWS_REGION": "eu-west-1"})
    assert (access.endpoint_url, access.region, access.access_key) == ("http://s3.local:9000", "eu-west-1",
                                                                       "test-key-id")
    assert "test-secret-key" not in repr(access) and "test-key-id" not in repr(access)


def test_the_credentials_file_is_read_only_when_only_its_owner_may(tmp_path):
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"access_key_id": "AKIAFILE", "secret_access_key": "file-secret",
                                "endpoint_url": "http://127.0.0.1:9000"}))
    os.chmod(path, 0o600)
    access = S3Access.from_environment({"HYBRIDFLOW_S3_CREDENTIALS_FILE": str(path)})
    assert (access.access_key, access.secret_key, access.endpoint_url) == ("AKIAFILE", "file-secret",
                                                                           "http://127.0.0.1:9000")
    os.chmod(path, 0o640)
    with pytest.raises(StorageError, match=r"mode 0640 lets others read the keys; it must be 0600"):
        S3Access.from_environment({"HYBRIDFLOW_S3_CREDENTIALS_FILE": str(path)})


@pytest.mark.parametrize("content, says", [
    ("{}", "expected a JSON object with access_key_id and secret_access_key"),
    ('{"access_key_id": "a"}', "expected a JSON object"),
    ('{"access_key_id": "", "secret_access_key": "s"}', "expected a JSON object"),
    ("[1]", "expected a JSON object"),
    ("not json", r"cannot read it \(JSONDecodeError\)"),
    (None, r"cannot read it \(FileNotFoundError\)"),
])
def test_a_credentials_file_that_is_not_one_is_refused_without_its_content(tmp_path, content, says):
    path = tmp_path / "s3.json"
    if content is not None:
        path.write_text(content)
        os.chmod(path, 0o600)
    with pytest.raises(StorageError, match=says) as error:
        S3Access.from_environment({"HYBRIDFLOW_S3_CREDENTIALS_FILE": str(path)})
    assert "HYBRIDFLOW_S3_CREDENTIALS_FILE" in str(error.value) and "secret" not in str(error.value).replace(
        "secret_access_key", "")
