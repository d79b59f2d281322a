"""The raw generator, the features job and batch scoring on either storage root: a real Spark in local mode (no
Hadoop S3 connector) and an S3 endpoint (moto's server in this process) against a POSIX folder. The same raw data
gives the same features, quarantine, manifest figures and predictions on both, and a training job reads the object
store's features as it reads the folder's. One Spark session for the module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from hybridjobs import cli, features, objectstore, partitions, scoring, storage
from hybridjobs.objectstore import open_uri
from hybridtrain.features import read_feature_partitions

pytest.importorskip("pyspark")

JOBS = Path(__file__).resolve().parents[4] / "jobs"
DAYS = ("2026-07-16", "2026-07-17")
SECRET = "test-secret-key-9f3a"


@pytest.fixture
def s3_root(s3_bucket, s3_endpoint, monkeypatch):
    """An ``s3://`` storage root, its keys and endpoint in the standard AWS environment (as the operator hands them
    to a job)."""
    bucket, _ = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    return f"s3://{bucket}/storage"


def generate_raw(root: str, ds: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(JOBS / "generate_raw.py"), "--root", root, "--ds", ds,
                           "--rows", "3000", "--customers", "150", *extra],
                          capture_output=True, text=True, timeout=120)


def features_table(root: str, ds: str) -> pa.Table:
    uri = partitions.partition_uri(root, "features", ds)
    if partitions.on_object_store(root):
        table = objectstore.read_partition(open_uri(uri))
    else:
        table = pa.concat_tables(pq.read_table(Path(uri) / name) for name in storage.data_files(uri))
    return table.sort_by("customer_id")


FIGURES = ("row_count", "feature_columns", "null_ratio", "nan_ratio", "label_rate", "feature_stats", "input")


def test_features_and_scoring_on_an_object_store_publish_what_they_publish_on_a_posix_root(spark, s3_root,
                                                                                          tmp_path):
    posix_root = str(tmp_path / "storage")
    for root in (posix_root, s3_root):
        for ds in DAYS:
            done = generate_raw(root, ds)
            assert done.returncode == 0, done.stderr
    on_posix = features.run(spark, posix_root, DAYS[1], lookback_days=2)
    on_s3 = features.run(spark, s3_root, DAYS[1], lookback_days=2)

    assert on_s3["input"]["lookback_partitions"] == list(DAYS)
    assert on_s3["quarantine"]["by_reason"] == on_posix["quarantine"]["by_reason"]
    assert sum(on_s3["quarantine"]["by_reason"].values()) > 0  # the generator plants defects: both quarantined them
    assert {key: on_s3[key] for key in FIGURES} == {key: on_posix[key] for key in FIGURES}
    assert features_table(s3_root, DAYS[1]).equals(features_table(posix_root, DAYS[1]))

    # What the object store holds under the partition is exactly what its manifest names.
    partition = open_uri(partitions.partition_uri(s3_root, "features", DAYS[1]))
    manifest = objectstore.read_manifest(partition)
    listed = {info.path.removeprefix(partition.path + "/") for info in partition.filesystem.get_file_info(
        pafs.FileSelector(partition.path, recursive=True)) if info.type == pafs.FileType.File}
    assert listed == {part["key"] for part in manifest["parts"]} | {"_MANIFEST.json", "_SUCCESS"}
    assert manifest["files"] == sorted(part["key"] for part in manifest["parts"])

    # A training job reads the object store's features as it reads the folder's.
    from_s3 = read_feature_partitions(f"{s3_root}/features", (DAYS[1],))
    from_posix = read_feature_partitions(f"{posix_root}/features", (DAYS[1],))
    assert from_s3.customer_ids.equals(from_posix.customer_ids)
    assert (from_s3.features == from_posix.features).all()
    assert SECRET not in json.dumps(manifest)

    # Batch scoring reads the features parts and publishes predictions on the object store as on POSIX.
    model_path = tmp_path / "model.pt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(len(features.FEATURE_COLUMNS), 1), torch.nn.Sigmoid()).eval()
    torch.jit.script(model).save(str(model_path))
    scored = {root: scoring.run(spark, root, DAYS[1], str(model_path), "v1") for root in (posix_root, s3_root)}
    assert scored[s3_root]["row_count"] == scored[posix_root]["row_count"] == on_posix["row_count"]
    # the same scores, summed in another order: equal to the last rounded digit
    assert scored[s3_root]["score_stats"] == pytest.approx(scored[posix_root]["score_stats"], abs=2e-6)
    s3_predictions = objectstore.read_partition(open_uri(partitions.partition_uri(s3_root, "predictions", DAYS[1])))
    posix_predictions = objectstore.read_partition(open_uri(partitions.partition_uri(posix_root, "predictions",
                                                                                  DAYS[1])))
    assert s3_predictions.sort_by("customer_id").equals(posix_predictions.sort_by("customer_id"))


def test_a_posix_partition_reads_through_the_object_store_reader_table_by_table(tmp_path):
    root = str(tmp_path / "storage")
    done = generate_raw(root, DAYS[0])
    assert done.returncode == 0, done.stderr
    partition = open_uri(partitions.partition_uri(root, "raw", DAYS[0]))
    manifest = objectstore.read_manifest(partition)  # _SUCCESS names this manifest's sha256
    assert {part.get("table") for part in manifest["parts"]} == {"events", "labels"}
    assert objectstore.read_partition(partition, ["customer_id"], table_name="events").num_rows == 3000
    assert objectstore.read_partition(partition, table_name="labels").num_rows == manifest["labels"]["row_count"]
    assert partitions.table_rows(root, "raw", DAYS[0], "events") == 3000


def test_generator_on_an_object_store_publishes_two_tables_and_skips_a_published_day(s3_root):
    done = generate_raw(s3_root, DAYS[0])
    assert done.returncode == 0, done.stderr
    partition = open_uri(partitions.partition_uri(s3_root, "raw", DAYS[0]))
    manifest = objectstore.read_manifest(partition)
    assert manifest["row_count"] == 3000 and manifest["planted_defects_total"] > 0
    events = objectstore.read_partition(partition, table_name="events")
    assert events.num_rows == 3000 and events.schema.field("customer_id").type == pa.binary()
    assert objectstore.read_partition(partition, table_name="labels").column_names == ["customer_id", "label"]
    assert partitions.table_rows(s3_root, "raw", DAYS[0], "events") == 3000

    again = generate_raw(s3_root, DAYS[0], "--skip-if-published")
    assert again.returncode == 0 and "already published" in again.stdout
    assert objectstore.read_manifest(partition) == manifest


@pytest.mark.parametrize("where", ["missing-bucket", "endpoint-down"])
def test_generator_and_features_job_fail_in_seconds_naming_the_uri_never_the_key(spark, s3_root, monkeypatch,
                                                                                where):
    if where == "missing-bucket":
        root = "s3://no-such-bucket-hybridflow/storage"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
        root = s3_root
    done = generate_raw(root, DAYS[0])
    assert done.returncode == cli.STORAGE_FAILED
    assert f"{root}/raw/ds={DAYS[0]}" in done.stderr and SECRET not in done.stderr + done.stdout

    with pytest.raises(objectstore.StorageError) as raised:
        features.run(spark, root, DAYS[0], lookback_days=1)
    assert f"{root}/raw/ds={DAYS[0]}" in str(raised.value) and SECRET not in str(raised.value)


def test_features_job_refuses_an_unpublished_raw_day_on_an_object_store(spark, s3_root):
    with pytest.raises(storage.PartitionNotPublishedError, match=f"raw partition {s3_root}/raw/ds=2026-07-17 is not"):
        features.run(spark, s3_root, DAYS[1], lookback_days=1)
