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
    ("published", 0, r"^SCORING ds=2026-01-05 rows=40 model_version=v1 device=(cpu|cuda) precision=fp32 seconds=\S+ "
                  r"rows_per_s="),
    ("not_published", 2, r"SCORING FAILED ds=2026-01-05: .*features/ds=2026-01-05 is not published"),
    ("wrong_model", 3, r"SCORING FAILED ds=2026-01-05: model .* cannot score \[B, 4\]"),
    ("probe", 0, r"^SCORING PROBE rows=2000 model_version=v1 device=(cpu|cuda) precision=fp32 seconds="),
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


def allow_bf16(model_path: Path, scoring: str = "bf16") -> None:
    """Record an export's bf16 check in the model's signature.json, as jobs/train.py's export does."""
    signature_path = model_path.with_name("signature.json")
    signature = json.loads(signature_path.read_text())
    signature["precision"] = {"scoring": scoring, "check": {"max_abs_diff": 0.002, "auc_diff": 0.0001,
                                                            "reason": "recorded by the test"}}
    signature_path.write_text(json.dumps(signature))


@pytest.mark.parametrize("requested, device, record, expected", [
    ("auto", "cuda", {"scoring": "bf16"}, "bf16"),
    ("auto", "cpu", {"scoring": "bf16"}, "fp32"),  # CPUs without bf16 units gain nothing from it
    ("auto", "cuda", {"scoring": "fp32"}, "fp32"),
    ("auto", "cuda", None, "fp32"),  # exported before the check existed
    ("fp32", "cuda", {"scoring": "bf16"}, "fp32"),
    ("bf16", "cpu", {"scoring": "bf16"}, "bf16"),
    ("bf16", "cuda", {"scoring": "bf16"}, "bf16"),
])
def test_precision_follows_the_export_check(requested, device, record, expected):
    assert local_scoring.resolve_precision(requested, device, record) == expected


@pytest.mark.parametrize("requested, record, error, message", [
    ("bf16", {"scoring": "fp32", "check": {"reason": "max |p_bf16 - p_fp32| 3.1e-02 (limit 0.01)"}},
     predictions.ModelContractError, r"did not allow it \(max \|p_bf16 - p_fp32\| 3.1e-02"),
    ("bf16", None, predictions.ModelContractError, "exported without a bf16 check"),
    ("fp16", {"scoring": "bf16"}, ValueError, "precision must be one of auto, fp32, bf16"),
    ("", None, ValueError, "precision must be one of"),
])
def test_precision_refusals_name_the_reason(requested, record, error, message):
    with pytest.raises(error, match=message):
        local_scoring.resolve_precision(requested, "cuda", record)


def test_bf16_scores_stay_within_the_export_limit_and_are_recorded(tmp_path):
    """The bf16 path on CPU autocast (CI has no GPU): same rows, scores within 0.01 of float32, manifest says so."""
    model = save_model(tmp_path / "model.pt")
    allow_bf16(tmp_path / "model.pt")
    columns = publish_features(tmp_path, 3000, files=2)
    manifest = local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v1", batch_size=512, device="cpu",
                                 precision="bf16")
    table, _ = read_predictions(tmp_path)
    scores = dict(zip(table.column("customer_id").to_pylist(), table.column("score").to_numpy(), strict=True))
    expected = dict(zip(columns["customer_id"], expected_scores(model, columns), strict=True))
    assert scores.keys() == expected.keys()
    difference = max(abs(scores[key] - expected[key]) for key in expected)
    assert 0 < difference <= 0.01, "bf16 autocast ran (scores differ) and stayed within the export's limit"
    assert manifest["job"]["precision"] == "bf16"
    assert manifest["job"]["precision_check"]["max_abs_diff"] == 0.002


@pytest.mark.parametrize("change, message", [
    ({"row_count": None}, r"row_count is None, expected a count"),
    ({"row_count": "40"}, r"row_count is '40'"),
    ({"row_count": -1}, r"row_count is -1"),
    ({"row_count": True}, r"row_count is True"),
    ({"feature_columns": None}, r"feature_columns is None, expected a non-empty list"),
    ({"feature_columns": []}, r"feature_columns is \[\]"),
    ({"feature_columns": ["visits_7d", 3]}, r"feature_columns is \['visits_7d', 3\]"),
    ({"feature_columns": ""}, r"feature_columns is ''"),
])
def test_a_features_manifest_without_its_fields_is_refused_with_a_fix(tmp_path, change, message):
    save_model(tmp_path / "model.pt")
    publish_features(tmp_path, 40)
    path = storage.partition_dir(tmp_path, "features", DS) / storage.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for key, value in change.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(storage.ManifestError, match=message + ".*republish the partition"):
        local_scoring.run(str(tmp_path), DS, str(tmp_path / "model.pt"), "v1", device="cpu")
    assert not (tmp_path / "predictions").exists()


@pytest.mark.parametrize("text", ["{", "[1, 2]", ""])
def test_a_features_manifest_that_is_not_a_json_object_is_refused(tmp_path, text):
    publish_features(tmp_path, 40)
    (storage.partition_dir(tmp_path, "features", DS) / storage.MANIFEST_NAME).write_text(text)
    with pytest.raises(storage.ManifestError, match="republish the partition"):
        storage.read_features_manifest(storage.partition_dir(tmp_path, "features", DS))


@pytest.mark.parametrize("case, exit_code, output", [
    ("no_row_count", 2, r"SCORING FAILED ds=2026-01-05: .*_MANIFEST.json: row_count is None.*republish"),
    ("bf16_not_allowed", 3, r"SCORING FAILED ds=2026-01-05: precision bf16 asked for.*without a bf16 check"),
    ("bf16", 0, r"^SCORING ds=2026-01-05 rows=40 model_version=v1 device=cpu precision=bf16 seconds="),
])
def test_cli_manifest_and_precision_exit_codes(tmp_path, case, exit_code, output):
    save_model(tmp_path / "model.pt")
    if case == "bf16":
        allow_bf16(tmp_path / "model.pt")
    publish_features(tmp_path, 40)
    if case == "no_row_count":
        path = storage.partition_dir(tmp_path, "features", DS) / storage.MANIFEST_NAME
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "row_count"}))
    common = ["--root", str(tmp_path), "--ds", DS, "--model", str(tmp_path / "model.pt"), "--model-version", "v1"]
    precision = [] if case == "no_row_count" else ["--device", "cpu", "--precision", "bf16"]
    done = run_cli(*common, *precision)
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert re.search(output, done.stdout + done.stderr, flags=re.M), done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_prefetched_keeps_order_and_raises_the_readers_error_in_place():
    def reader():
        yield from range(5)
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for item in local_scoring.prefetched(reader(), depth=2):
            seen.append(item)
    assert seen == [0, 1, 2, 3, 4]


def test_prefetched_stops_its_reader_when_the_consumer_stops_early():
    produced = []

    def reader():
        for item in range(1000):
            produced.append(item)
            yield item

    items = local_scoring.prefetched(reader(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert len(produced) <= 3 + 2 + 2, "the reader ran on past the consumer"
