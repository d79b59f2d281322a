"""batch_inference routed to the GPU side on the real local stack: the workload_router DAG runs
jobs/score_batch_local.py as a Slurm job with one GPU on the gpu-training partition (torch, no Spark), which
publishes the predictions partition the Spark route publishes; the Spark route then scores the same features with
the same model, and the two agree row by row."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.dag_runs import task_states
from hybridflow.layout import StorageLayout
from hybridjobs import storage

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "workload_router"
SOURCE = (REPO / "dags" / f"{DAG_ID}.py").read_text()
GPU_PROFILE = {"gpu_speedup": 8, "batch_rows": 2_000_000}  # meets the gpu-pays-off rule
ROWS, FILES = 5000, 2
RUN_TASKS = ("run_on_cpu_spark", "run_on_gpu_slurm", "run_on_cpu_slurm", "serve_on_triton")


@pytest.fixture
def scoring_ds(stack, model_of_record):
    """A published features partition of its own on the shared storage, under a far-away ds no nightly run
    writes, in the model of record's feature columns; its features and predictions are removed afterwards."""
    root = Path(stack["HYBRIDFLOW_STORAGE_ROOT"])
    ds = (date(2400, 1, 1) + timedelta(days=uuid.uuid4().int % 100_000)).isoformat()
    signature = json.loads((Path(model_of_record["export_dir"]) / "signature.json").read_text())
    feature_columns = list(signature["feature_columns"])
    generator = np.random.default_rng(7)
    target = storage.partition_dir(root, "features", ds)
    staging = storage.new_staging_dir(target)
    staging.mkdir()
    for index, ids in enumerate(np.array_split(np.arange(ROWS), FILES)):
        columns = {"customer_id": pa.array([f"C{i}" for i in ids], pa.string()),
                   "label": pa.array(generator.integers(0, 2, len(ids), dtype=np.int32))}
        columns |= {name: pa.array(generator.normal(size=len(ids)).astype(np.float32)) for name in feature_columns}
        pq.write_table(pa.table(columns), staging / f"part-{index:05d}.parquet")
    manifest = storage.base_manifest("features", ds, ROWS, [], {"name": "test_router_gpu_scoring"})
    manifest["feature_columns"] = feature_columns
    storage.publish(staging, target, manifest)
    yield ds
    for dataset in ("features", "predictions"):
        partition = storage.partition_dir(root, dataset, ds)
        for path in (partition, *partition.parent.glob(f".{partition.name}.*")):
            shutil.rmtree(path, ignore_errors=True)


def published_predictions(root: Path, ds: str) -> tuple[pa.Table, dict]:
    partition = storage.partition_dir(root, "predictions", ds)
    return pq.read_table(partition).sort_by("customer_id"), storage.read_manifest(partition)


def test_router_scores_a_large_batch_on_one_gpu_like_the_spark_route(run_dag, slurm, stack, scoring_ds,
                                                                     model_of_record):
    root = Path(stack["HYBRIDFLOW_STORAGE_ROOT"])
    config = {"ds": scoring_ds}
    runs = []
    try:
        gpu = run_dag(SOURCE, DAG_ID, {"workload_type": "batch_inference", "config": config,
                                       "profile": GPU_PROFILE})
        runs.append(gpu["run_id"])
        assert gpu["state"] == "success", gpu["log"][-4000:]
        decision = gpu["tasks"]["route"]["xcom"]["decision"]
        assert (decision["side"], decision["target"], decision["rule"]) == ("gpu", "slurm_gpu", "gpu-pays-off")
        assert task_states(gpu)["run_on_gpu_slurm"] == "success"
        assert {task_states(gpu)[t] for t in RUN_TASKS if t != "run_on_gpu_slurm"} == {"skipped"}
        job_id = gpu["tasks"]["run_on_gpu_slurm"]["xcom"]["slurm_job_id"]
        accounted = slurm.run(["sacct", "-X", "-P", "-n", "-j", job_id,
                               "--format=State,Partition,AllocTRES"]).stdout.strip()
        state, partition, tres = accounted.split("|")
        assert (state, partition) == ("COMPLETED", "gpu-training")
        assert "gres/gpu=1" in tres.split(",")

        gpu_table, gpu_manifest = published_predictions(root, scoring_ds)
        features_manifest = storage.read_manifest(storage.partition_dir(root, "features", scoring_ds))
        assert gpu_manifest["row_count"] == features_manifest["row_count"] == gpu_table.num_rows == ROWS
        model_path = model_of_record["model_path"]
        assert gpu_manifest["model"] == {"path": model_path, "version": model_of_record["version"],
                                         "sha256": hashlib.sha256(Path(model_path).read_bytes()).hexdigest()}
        job = gpu_manifest["job"]
        assert (job["name"], job["slurm_job_id"]) == ("score_batch_local", job_id)
        assert job["device"] in ("cuda", "cpu") and (job["gpu"] is None) == (job["device"] == "cpu")
        assert job["cuda_visible_devices"].isdigit(), job  # Slurm bound exactly one GPU to the job
        assert job["host"] in ("gpu-node-01", "gpu-node-02")

        spark = run_dag(SOURCE, DAG_ID, {"workload_type": "batch_inference", "config": config})
        runs.append(spark["run_id"])
        assert spark["state"] == "success", spark["log"][-4000:]
        assert spark["tasks"]["route"]["xcom"]["decision"]["target"] == "spark"
        assert task_states(spark)["run_on_cpu_spark"] == "success"
        spark_table, spark_manifest = published_predictions(root, scoring_ds)
        assert spark_manifest["job"]["name"] == "score_batch"

        for key in ("row_count", "columns", "model", "feature_columns"):
            assert gpu_manifest[key] == spark_manifest[key], key
        assert [(f.name, f.type) for f in gpu_table.schema] == [(f.name, f.type) for f in spark_table.schema] == \
            [("customer_id", pa.string()), ("score", pa.float32()), ("model_version", pa.string())]
        assert gpu_table.column("customer_id").equals(spark_table.column("customer_id"))
        assert set(gpu_table.column("model_version").to_pylist()) == {model_of_record["version"]}
        assert set(spark_table.column("model_version").to_pylist()) == {model_of_record["version"]}
        np.testing.assert_allclose(gpu_table.column("score").to_numpy(), spark_table.column("score").to_numpy(),
                                   rtol=0, atol=1e-5)
    finally:
        for run_id in runs:
            slurm.run(["rm", "-rf", "--", StorageLayout(str(root)).router_run_dir(run_id)])
