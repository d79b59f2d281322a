"""The Spark-free batch scorer of the Slurm GPU route (hybridjobs.local_scoring, jobs/score_batch_local.py): scores,
the published partition and its manifest, the refusals, the probe and the CLI's exit codes."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hybridjobs import local_scoring, predictions, storage

JOBS = Path(__file__).resolve().parents[4] / "jobs"

DS = "2026-01-05"
# The manifest's order is neither the files' order (reversed below) nor alphabetical.
FEATURES = ("visits_7d", "spend_30d", "basket_mean", "discount_share")
# The same file schema as the Spark route's (model_version on every row, so required).
PREDICTIONS_SCHEMA = pa.schema([("customer_id", pa.string()), ("score", pa.float32()),
                                pa.field("model_version", pa.string(), nullable=False)])
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")


@pytest.fixture(autouse=True)
def torch_threads():
    """The scorer sets torch's threads for its process; other tests in this process keep their own setting."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def save_model(path: Path, n_features: int = len(FEATURES), out_features: int = 1) -> torch.nn.Module:
    """A small TorchScript model with the export's signature.json beside it (the probe reads its width)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_features, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, out_features), torch.nn.Sigmoid()).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(model).save(str(path))
    path.with_name("signature.json").write_text(json.dumps({"n_features": n_features}))
    return model


def publish_features(root: Path, rows: int, files: int = 1, ds: str = DS, row_count: int | None = None) -> dict:
    """A published features partition of ``rows`` rows over ``files`` files (columns in reverse manifest order);
    returns its columns by name. ``row_count`` overrides what the manifest claims."""
    generator = np.random.default_rng(rows)
    columns = {"customer_id": np.array([f"c{i:06d}" for i in range(rows)], dtype=object),
               "label": generator.integers(0, 2, rows, dtype=np.int32)}
    columns |= {name: generator.normal(size=rows).astype(np.float32) for name in reversed(FEATURES)}
    target = storage.partition_dir(root, "features", ds)
    staging = storage.new_staging_dir(target)
    staging.mkdir()
    for index, part in enumerate(np.array_split(np.arange(rows), files)):
        table = pa.table({name: pa.array(values[part], pa.string() if name == "customer_id" else None)
                          for name, values in columns.items()})
        pq.write_table(table, staging / f"part-{index:05d}.parquet")
    manifest = storage.base_manifest("features", ds, rows if row_count is None else row_count, [], {"name": "test"})
    manifest["feature_columns"] = list(FEATURES)
    storage.publish(staging, target, manifest)
    return columns


def read_predictions(root: Path, ds: str = DS) -> tuple[pa.Table, dict]:
    partition = storage.partition_dir(root, "predictions", ds)
    return pq.read_table(partition), storage.read_manifest(partition)


def expected_scores(model: torch.nn.Module, columns: dict) -> np.ndarray:
    inputs = np.column_stack([columns[name] for name in FEATURES]).astype(np.float32)
    with torch.inference_mode():
        return model(torch.from_numpy(inputs)).numpy().reshape(-1)


@pytest.mark.parametrize("rows, files, batch_size", [
    (1, 1, 65_536),
    (1000, 1, 128),
    (1000, 3, 333),
    (10, 2, 3),
    (0, 1, 16),
])
def test_scores_are_the_model_applied_in_the_manifest_column_order(tmp_path, rows, files, batch_size):
    model = save_model(tmp_path / "model.pt")
    columns = publish_features(tmp_path, rows, files)
    local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v3", batch_size, "cpu")
    table, manifest = read_predictions(tmp_path)
    assert table.schema == PREDICTIONS_SCHEMA
    assert table.column("customer_id").to_pylist() == list(columns["customer_id"])
    np.testing.assert_allclose(table.column("score").to_numpy(), expected_scores(model, columns), rtol=1e-6)
    assert set(table.column("model_version").to_pylist()) <= {"v3"}
    assert manifest["row_count"] == rows
    # streamed: one output file per input file, a row group per batch
    partition = storage.partition_dir(tmp_path, "predictions", DS)
    outputs = [partition / name for name in storage.data_files(partition)]
    assert len(outputs) == files
    inputs = [len(part) for part in np.array_split(np.arange(rows), files)]
    assert [pq.ParquetFile(out).metadata.num_row_groups for out in outputs] == \
        [-(-n // batch_size) for n in inputs]


def test_partition_is_published_atomically_with_the_predictions_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-02")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    model_path = tmp_path / "models" / "v3" / "model.pt"
    save_model(model_path)
    publish_features(tmp_path, 500, 2)
    returned = local_scoring.run(str(tmp_path), DS, str(model_path), "v3", 100, "cpu")
    _, manifest = read_predictions(tmp_path)
    assert returned == manifest
    assert {k: manifest[k] for k in ("dataset", "ds", "row_count", "columns", "feature_columns")} == {
        "dataset": "predictions", "ds": DS, "row_count": 500,
        "columns": [{"name": "customer_id", "type": "string"}, {"name": "score", "type": "float32"},
                    {"name": "model_version", "type": "string"}],
        "feature_columns": list(FEATURES)}
    assert manifest["model"] == {"path": str(model_path), "version": "v3",
                                 "sha256": hashlib.sha256(model_path.read_bytes()).hexdigest()}
    assert manifest["features_manifest"]["row_count"] == 500
    assert manifest["files"] == ["part-00000.parquet", "part-00001.parquet"]
    job = manifest["job"]
    assert {k: job[k] for k in ("name", "device", "gpu", "cuda_visible_devices", "batch_size", "slurm_job_id",
                                "host")} == {
        "name": "score_batch_local", "device": "cpu", "gpu": None, "cuda_visible_devices": "0", "batch_size": 100,
        "slurm_job_id": "4242", "host": "gpu-node-02"}
    assert job["torch_threads"] == local_scoring.allotted_cpus() and job["seconds"] >= 0
    assert 0 <= manifest["score_stats"]["min"] <= manifest["score_stats"]["max"] <= 1
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == [f"ds={DS}"]  # no staging left


def test_a_rerun_replaces_the_partition(tmp_path):
    save_model(tmp_path / "model.pt")
    publish_features(tmp_path, 300, 3)
    local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v1", device="cpu")
    publish_features(tmp_path, 200, 1)
    local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v2", device="cpu")
    table, manifest = read_predictions(tmp_path)
    assert (table.num_rows, manifest["row_count"], manifest["files"]) == (200, 200, ["part-00000.parquet"])
    assert set(table.column("model_version").to_pylist()) == {"v2"}
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == [f"ds={DS}"]


def test_a_row_count_that_disagrees_with_the_features_manifest_publishes_nothing(tmp_path):
    save_model(tmp_path / "model.pt")
    publish_features(tmp_path, 100, row_count=101)
    with pytest.raises(RuntimeError, match=r"scored 100 rows but features/ds=2026-01-05 has 101: not publishing"):
        local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v1", device="cpu")
    assert not storage.is_published(storage.partition_dir(tmp_path, "predictions", DS))
    (staging,) = (tmp_path / "predictions").iterdir()  # left for inspection
    assert staging.name.startswith(f".ds={DS}.staging-")


@pytest.mark.parametrize("publish, model, version, device, error, message", [
    (False, (4, 1), "v1", "cpu", storage.PartitionNotPublishedError, "features/ds=2026-01-05 is not published"),
    (True, (5, 1), "v1", "cpu", predictions.ModelContractError, r"cannot score \[B, 4\]"),
    (True, (4, 2), "v1", "cpu", predictions.ModelContractError, r"must return float32 \[B, 1\]"),
    (True, (4, 1), " ", "cpu", ValueError, "model_version must not be empty"),
    (True, (4, 1), "v1", "tpu", ValueError, "device must be one of auto, cpu, cuda"),
    pytest.param(True, (4, 1), "v1", "cuda", ValueError, "device cuda asked for, but torch .* sees no GPU",
                 marks=NO_GPU),
])
def test_bad_input_is_refused_before_any_row_is_scored(tmp_path, publish, model, version, device, error, message):
    save_model(tmp_path / "model.pt", *model)
    if publish:
        publish_features(tmp_path, 50)
    with pytest.raises(error, match=message):
        local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), version, device=device)
    assert not (tmp_path / "predictions").exists()  # nothing staged


def test_probe_scores_synthetic_rows_and_publishes_nothing(tmp_path):
    save_model(tmp_path / "model.pt")
    job = local_scoring.probe(str(tmp_path / "model.pt"), "v1", 1000, batch_size=300, device="auto")
    assert {k: job[k] for k in ("name", "rows", "n_features", "device", "batch_size")} == {
        "name": "score_batch_local probe", "rows": 1000, "n_features": len(FEATURES),
        "device": "cuda" if torch.cuda.is_available() else "cpu", "batch_size": 300}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "signature.json"]


def test_probe_needs_the_models_signature(tmp_path):
    save_model(tmp_path / "model.pt")
    (tmp_path / "signature.json").unlink()
    with pytest.raises(predictions.ModelContractError, match="cannot read the model's input width"):
        local_scoring.probe(str(tmp_path / "model.pt"), "v1", 1000)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter where pyspark cannot be imported, as in the cluster's job environment (and
    neither Airflow nor the package: jobs/ never imports them)."""
    script = JOBS / "score_batch_local.py"
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in ("pyspark", "airflow", "hybridflow"))
    code = (f"import runpy, sys; {blocked}; "
            f"sys.argv = [{str(script)!r}, *sys.argv[1:]]; runpy.run_path({str(script)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case, exit_code, output", [
    ("published", 0, r"^SCORING ds=2026-01-05 rows=40 model_version=v1 device=(cpu|cuda) seconds=\S+ rows_per_s="),
    ("not_published", 2, r"SCORING FAILED ds=2026-01-05: .*features/ds=2026-01-05 is not published"),
    ("wrong_model", 3, r"SCORING FAILED ds=2026-01-05: model .* cannot score \[B, 4\]"),
    ("probe", 0, r"^SCORING PROBE rows=2000 model_version=v1 device=(cpu|cuda) seconds="),
    ("no_ds", 2, "--root and --ds are required"),
    ("bad_ds", 2, "YYYY-MM-DD"),
    pytest.param("cuda", 2, "device cuda asked for", marks=NO_GPU),
])
def test_cli_exit_codes(tmp_path, case, exit_code, output):
    save_model(tmp_path / "model.pt", n_features=5 if case == "wrong_model" else 4)
    if case != "not_published":
        publish_features(tmp_path, 40)
    common = ["--model", str(tmp_path / "model.pt"), "--model-version", "v1"]
    args = {
        "probe": ["--probe-rows", "2000", *common],
        "no_ds": ["--root", str(tmp_path), *common],
        "bad_ds": ["--root", str(tmp_path), "--ds", "2026-1-5", *common],
        "cuda": ["--root", str(tmp_path), "--ds", DS, "--device", "cuda", *common],
    }.get(case, ["--root", str(tmp_path), "--ds", DS, *common])
    done = run_cli(*args)
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert re.search(output, done.stdout + done.stderr, flags=re.M), done.stdout + done.stderr
    assert storage.is_published(storage.partition_dir(tmp_path, "predictions", DS)) == (case == "published")
