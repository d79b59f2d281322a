"""The nightly's data stages on an object-store root: the real nightly DAG (its raw, features, quality and report
tasks; training and scoring are the next steps of issue 38) runs through Airflow's task lifecycle with
``storage.root = s3://<a new bucket>/root`` on the stack's S3 endpoint. The raw generator and the Spark job get
the storage connection's access in their environment; Airflow's side reads the partitions and writes the report
through ObjectStoragePath; the UI's report route reads it back. Nothing lands on the stack's POSIX root, and the
keys appear in no task log."""

from __future__ import annotations

import json
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from helpers.dag_runs import runner_argv, write_dag_file
from helpers.stack import s3_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DS = "2024-03-05"
TASKS = ["preflight.plan", "preflight.simulate_raw_events", "preflight.raw_events_published",
         "features.build_features", "quality.quality_gate", "report.write_report"]


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    return {key[len(prefix):]: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


def test_raw_features_quality_and_report_run_on_s3_with_nothing_on_the_shared_disk(stack, isolated_airflow_env):
    from hybridflow.ui import read_report_object

    s3, conn = s3_client(stack)
    bucket = f"hf-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    root = f"s3://{bucket}/root"
    posix_root = Path(stack["HYBRIDFLOW_STORAGE_ROOT"])
    env = dict(isolated_airflow_env, HYBRIDFLOW_STORAGE_ROOT=root, HYBRIDFLOW_SIMULATE_RAW="true",
               HYBRIDFLOW_SIMULATE_RAW_ROWS="20000")
    # Only the data stages: scoring needs a model of record, which this test's MLflow may not have. The original
    # DAG leaves Airflow's auto-registration so that the subset is the file's DAG; the run deadline is not under
    # test, and dag.test() cannot store the subset's copy of it (Airflow 3.3.2).
    source = (REPO / "dags" / "nightly_training.py").read_text() + textwrap.dedent(f"""
        from airflow.sdk.definitions._internal.contextmanager import DagContext
        DagContext.autoregistered_dags.clear()
        dag.deadline = None
        dag = dag.partial_subset(task_ids={TASKS!r}, include_upstream=False, include_downstream=False)
    """)
    argv = runner_argv(write_dag_file(env, source, "nightly_training"), "nightly_training",
                       {"train": "never", "deploy": "never"}, f"{DS}T00:00:00+00:00")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (rc {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    states = {task: info["state"] for task, info in result["tasks"].items()}
    assert result["state"] == "success" and states == dict.fromkeys(TASKS, "success"), (states, done.stdout[-4000:])

    # Every stage's partition is published on the object store, bound to its _SUCCESS.
    manifests = {}
    for dataset in ("raw", "quarantine", "features"):
        found = objects(s3, bucket, f"root/{dataset}/ds={DS}/")
        assert json.loads(found["_SUCCESS"])["manifest_sha256"], dataset
        manifests[dataset] = json.loads(found["_MANIFEST.json"])
        named = {part["key"] for part in manifests[dataset]["parts"]}
        # nothing but what the manifest names (and the empty "folder" keys pyarrow leaves when it deletes a key)
        markers = {key for key, body in found.items() if key.endswith("/") and not body}
        assert set(found) - markers == named | {"_SUCCESS", "_MANIFEST.json"}, dataset
    assert manifests["raw"]["row_count"] == 20000 and manifests["features"]["row_count"] > 100

    # The quality gate read the features manifest from S3 (its figures are that manifest's).
    gate = result["tasks"]["quality.quality_gate"]["xcom"]["return_value"]
    assert gate["summary"]["failed"] == 0 and gate["figures"]["feature_rows"] == manifests["features"]["row_count"]
    assert gate["figures"]["raw_rows"] == 20000

    # The report is on S3, report.json with it, and the UI's route reads it through the connection.
    report = result["tasks"]["report.write_report"]["xcom"]["return_value"]
    assert report["html"].startswith(f"{root}/reports/nightly_training/ds={DS}/")
    relative = report["url_path"].removeprefix("nightly_training/")
    page = read_report_object(root, "storage_s3", "nightly_training", relative)
    assert page is not None and b"<html" in page.lower()
    assert read_report_object(root, "storage_s3", "nightly_training", "../" + relative) is None

    # Nothing on the shared disk, no stray folder named after the URI, and no key in any task's log.
    for dataset in ("raw", "quarantine", "features"):
        assert not (posix_root / dataset / f"ds={DS}").exists()
    assert not (REPO / "s3:").exists() and not Path("s3:").exists()
    assert conn["password"] not in done.stdout + done.stderr
