"""Airflow's side reads the datasets' partitions through ObjectStoragePath (hooks/storage_root.py), on a local root and
on an S3 endpoint (moto's server, tests/conftest.py) alike. The partitions are written by the real producer, the
raw generator job, with the access the hook hands it; the connection is an Airflow `aws` connection from the
environment, as a deployment's secrets backend would give it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from hybridflow.exceptions import HybridflowError
from hybridflow.hooks.storage_root import StorageRoot, StorageUnreachableError, published_manifest

JOBS = Path(__file__).resolve().parents[3] / "jobs"
SECRET = "test-secret-key-7c1e"
DAYS = ("2026-03-01", "2026-03-02")


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


MANIFEST = json.dumps({"ds": "2026-03-01", "row_count": 3}).encode()


@pytest.mark.parametrize("success, manifest, expected", [
    (b"", MANIFEST, {"ds": "2026-03-01", "row_count": 3}),  # published by a rename, before the manifest protocol
    (json.dumps({"manifest_sha256": sha(MANIFEST)}).encode(), MANIFEST, {"ds": "2026-03-01", "row_count": 3}),
    (json.dumps({"manifest_sha256": sha(b"{}")}).encode(), MANIFEST, None),  # a commit in progress
])
def test_published_manifest_is_the_one_success_names(success, manifest, expected):
    assert published_manifest(success, manifest) == expected


@pytest.mark.parametrize("success, manifest, says", [
    (b"done", MANIFEST, "not what the manifest-v1 protocol writes"),
    (b'{"sha": 1}', MANIFEST, "not what the manifest-v1 protocol writes"),
    (b"[]", MANIFEST, "not what the manifest-v1 protocol writes"),
    (b"", b"{not json", "_MANIFEST.json is not JSON"),
    (b"", b"[1, 2]", "_MANIFEST.json holds a list, not a JSON object"),
    (json.dumps({"manifest_sha256": sha(b"null")}).encode(), b"null", "_MANIFEST.json holds a NoneType"),
])
def test_a_success_or_manifest_no_writer_of_ours_wrote_is_refused_saying_rerun(success, manifest, says):
    with pytest.raises(HybridflowError, match=f"{says}.*rerun the stage"):
        published_manifest(success, manifest)


@pytest.fixture
def s3_conn(s3_endpoint, monkeypatch):
    """A bucket on the endpoint, the id of an `aws` connection that reaches it, and the endpoint."""
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="test-key-id",
                 aws_secret_access_key=SECRET).create_bucket(Bucket=bucket)
    monkeypatch.setenv("AIRFLOW_CONN_TEST_STORAGE", json.dumps({
        "conn_type": "aws", "login": "test-key-id", "password": SECRET,
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}}))
    return bucket, "test_storage", s3_endpoint


def generate_raw(store: StorageRoot, ds: str) -> None:
    """The raw generator job, given this store's access in its environment as the nightly's task gives it."""
    env = {"PATH": "/usr/bin:/bin", **store.job_environment()}
    done = subprocess.run([sys.executable, str(JOBS / "generate_raw.py"), "--root", store.root, "--ds", ds,
                           "--rows", "400"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_the_store_sees_what_the_generator_publishes_alike_on_a_folder_and_on_s3(tmp_path, s3_conn):
    bucket, conn_id, _ = s3_conn
    stores = [StorageRoot(str(tmp_path / "storage")), StorageRoot(f"s3://{bucket}/hybridflow", conn_id)]
    assert stores[0].job_environment() == {}
    environment = stores[1].job_environment()
    assert environment["AWS_SECRET_ACCESS_KEY"] == SECRET and environment["AWS_ENDPOINT_URL_S3"].startswith("http")

    seen = []
    for store in stores:
        assert store.published_ds("raw") == [] and not store.is_published("raw", DAYS[0])
        for ds in DAYS:
            generate_raw(store, ds)
        manifest = store.manifest("raw", DAYS[1])
        assert manifest["parts"] and store.published_ds("raw") == list(DAYS)
        assert store.published_manifests("raw")[DAYS[1]] == manifest
        seen.append({key: manifest[key] for key in ("ds", "row_count", "protocol")})
    assert seen[0] == seen[1] == {"ds": DAYS[1], "row_count": 400, "protocol": "manifest-v1"}


def test_a_manifest_replaced_under_its_success_is_a_commit_in_progress_not_a_partition(s3_conn):
    bucket, conn_id, endpoint = s3_conn
    store = StorageRoot(f"s3://{bucket}/root", conn_id)
    generate_raw(store, DAYS[0])
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test-key-id",
                          aws_secret_access_key=SECRET)
    client.put_object(Bucket=bucket, Key=f"root/raw/ds={DAYS[0]}/_MANIFEST.json",
                      Body=b'{"ds": "2026-03-01", "row_count": 1}')
    assert store.manifest("raw", DAYS[0]) is None and store.published_ds("raw") == []


@pytest.mark.parametrize("case", ["missing-bucket", "dead-endpoint"])
def test_a_store_it_cannot_reach_fails_in_seconds_naming_the_uri_and_connection_never_the_key(
        case, s3_conn, monkeypatch):
    bucket, conn_id, _ = s3_conn
    if case == "dead-endpoint":  # nothing listens on the discard port
        monkeypatch.setenv("AIRFLOW_CONN_DEAD_STORAGE", json.dumps({
            "conn_type": "aws", "login": "test-key-id", "password": SECRET,
            "extra": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}))
        store, says = StorageRoot(f"s3://{bucket}/root", "dead_storage"), f"cannot read s3://{bucket}/root/raw"
    else:
        store, says = StorageRoot("s3://no-such-bucket-4d1/root", conn_id), "bucket no-such-bucket-4d1"
    for read in (lambda: store.is_published("raw", DAYS[0]), lambda: store.published_ds("raw")):
        started = time.monotonic()
        with pytest.raises(StorageUnreachableError) as raised:
            read()
        assert time.monotonic() - started < 30
        assert says in str(raised.value) and repr(store.conn_id) in str(raised.value)
        assert SECRET not in str(raised.value)


def test_a_report_folder_copied_again_replaces_the_earlier_one_and_reads_back(tmp_path, s3_conn):
    bucket, conn_id, _ = s3_conn
    store = StorageRoot(f"s3://{bucket}/root", conn_id)
    uri = f"{store.root}/reports/nightly_training/ds={DAYS[0]}/run"
    for files in ({"report.json": b"{}", "report.html": b"<html>1", "old_chart.png": b"png"},
                  {"report.json": b'{"v": 2}', "report.html": b"<html>2"}):
        folder = tmp_path / str(len(files))
        folder.mkdir()
        for name, body in files.items():
            (folder / name).write_bytes(body)
        written = store.publish_folder(folder, uri, last="report.json")
        assert written[-1] == f"{uri}/report.json" and len(written) == len(files)
    assert store.read_bytes(f"{uri}/report.html") == b"<html>2"
    assert store.read_bytes(f"{uri}/old_chart.png") is None and store.read_bytes(f"{uri}/nothing") is None
