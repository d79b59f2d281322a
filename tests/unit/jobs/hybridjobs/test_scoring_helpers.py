"""Pieces of the scoring job that need no Spark: the model input of an Arrow batch, the row-group plan, the
mapInArrow body (a task's predictions file), the per-worker model cache, the checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hybridjobs import datasets, scoring, storage


def save_model(path: Path, n_features: int, out_features: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_features, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, out_features), torch.nn.Sigmoid()).eval()
    torch.jit.script(model).save(str(path))
    return model


def f32(*values):
    return pa.array(values, pa.float32())


@pytest.mark.parametrize("columns, feature_columns, expected", [
    ({"c": f32(3), "customer_id": pa.array(["x"]), "a": f32(1), "b": f32(2)}, ("a", "b", "c"), [[1, 2, 3]]),
    ({"a": f32(1, 4), "b": f32(2, 5)}, ("b", "a"), [[2, 1], [5, 4]]),
    ({"a": f32(1.5, None)}, ("a",), [[1.5], [np.nan]]),
    ({"a": pa.array([0.1], pa.float64()), "b": pa.array([7], pa.int32())}, ("a", "b"), [[0.1, 7]]),
    ({"a": f32()}, ("a",), np.empty((0, 1))),
])
def test_batch_inputs_are_float32_in_manifest_order(columns, feature_columns, expected):
    inputs = scoring.batch_inputs(pa.record_batch(columns), feature_columns)
    assert inputs.dtype == np.float32
    np.testing.assert_array_equal(inputs, np.asarray(expected, dtype=np.float32))


def test_batch_inputs_copy_the_features_once_into_one_block():
    inputs = scoring.batch_inputs(pa.record_batch({"a": f32(1, 2), "b": f32(3, 4)}), ("a", "b"))
    assert inputs.base is not None and inputs.base.flags.c_contiguous and inputs.base.shape == (2, 2)


@pytest.mark.parametrize("row_groups, tasks, expected", [
    ([], 2, [[]]),
    ([("f", 0, 10)], 4, [[("f", 0)]]),
    ([("f", 0, 10), ("f", 1, 10), ("g", 0, 10)], 0, [[("f", 0), ("f", 1), ("g", 0)]]),
    ([("a", 0, 100), ("a", 1, 60), ("b", 0, 50), ("b", 1, 10)], 2, [[("a", 0), ("b", 1)], [("a", 1), ("b", 0)]]),
    ([("a", 0, 5), ("b", 0, 5), ("c", 0, 5), ("d", 0, 5)], 2, [[("a", 0), ("c", 0)], [("b", 0), ("d", 0)]]),
])
def test_assign_row_groups_balances_rows_over_at_most_one_task_per_core(row_groups, tasks, expected):
    assert scoring.assign_row_groups(row_groups, tasks) == expected


def write_features(path: Path, rows: int, row_group_size: int) -> pa.Table:
    rng = np.random.default_rng(0)
    features = pa.table({"c": rng.normal(size=rows).astype(np.float32), "customer_id": [f"C{i}" for i in range(rows)],
                         "a": rng.normal(size=rows).astype(np.float32), "b": rng.normal(size=rows).astype(np.float32)})
    pq.write_table(features, path, row_group_size=row_group_size)
    return features


def test_plan_reads_the_row_groups_from_the_footers(tmp_path):
    write_features(tmp_path / "part-0.parquet", 7, 4)
    write_features(tmp_path / "part-1.parquet", 3, 4)
    (tmp_path / "_MANIFEST.json").write_text("{}")
    first, second = str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")
    assert scoring.plan(tmp_path, 2) == [[(first, 0)], [(first, 1), (second, 0)]]


def test_score_tasks_write_one_predictions_file_per_task_with_the_contract_schema(tmp_path):
    model = save_model(tmp_path / "m.pt", 3)
    features = write_features(tmp_path / "features.parquet", 7, 4)
    path = str(tmp_path / "features.parquet")
    tasks = [[(path, 1)], [(path, 0), (path, 1)], []]
    staging = tmp_path / "staging"
    staging.mkdir()

    sink = datasets.PartSink(staging=str(staging))
    written = list(scoring.score_tasks(iter([pa.record_batch({"id": [1, 2]})]), tasks, sink,
                                       str(tmp_path / "m.pt"), ("a", "b", "c"), "v7", batch_size=3))

    assert pa.Table.from_batches(written).to_pylist() == [
        {"key": "part-00001.parquet", "rows": 7, "bytes": None, "sha256": None},
        {"key": "part-00002.parquet", "rows": 0, "bytes": None, "sha256": None}]
    assert sorted(p.name for p in staging.iterdir()) == ["part-00001.parquet", "part-00002.parquet"]
    scored = pq.read_table(staging / "part-00001.parquet")
    assert scored.schema.equals(scoring.SCHEMA)
    assert [c["name"] for c in scoring.COLUMNS] == scored.column_names
    assert pq.ParquetFile(staging / "part-00001.parquet").metadata.num_row_groups == 3  # batches of 3, per row group
    assert scored["customer_id"].to_pylist() == [f"C{i}" for i in range(7)]
    assert set(scored["model_version"].to_pylist()) == {"v7"}
    inputs = np.stack([features[c].to_numpy() for c in ("a", "b", "c")], axis=1)
    expected = model(torch.from_numpy(inputs)).detach().numpy().reshape(-1)
    np.testing.assert_allclose(scored["score"].to_numpy(), expected, rtol=1e-6)
    assert pq.read_table(staging / "part-00002.parquet").schema.equals(scoring.SCHEMA)
    assert torch.get_num_threads() == 1  # one Python worker per core already

    retried = list(scoring.score_tasks(iter([pa.record_batch({"id": [1]})]), tasks, sink,
                                       str(tmp_path / "m.pt"), ("a", "b", "c"), "v7", batch_size=3))
    assert pa.Table.from_batches(retried)["rows"].to_pylist() == [7]
    assert sorted(p.name for p in staging.iterdir()) == ["part-00001.parquet", "part-00002.parquet"]
    assert pq.read_table(staging / "part-00001.parquet").equals(scored)


def test_model_is_loaded_once_per_process_and_path(tmp_path):
    save_model(tmp_path / "m.pt", 2)
    first = scoring.load_model(str(tmp_path / "m.pt"))
    assert scoring.load_model(str(tmp_path / "m.pt")) is first


@pytest.mark.parametrize("n_features, out_features, message", [
    (4, 1, r"cannot score \[B, 3\]"),
    (3, 2, r"must return float32 \[B, 1\]"),
])
def test_check_model_rejects_a_model_that_does_not_fit(tmp_path, n_features, out_features, message):
    path = tmp_path / f"m{n_features}{out_features}.pt"
    save_model(path, n_features, out_features)
    with pytest.raises(scoring.ModelContractError, match=message):
        scoring.check_model(str(path), 3)


def test_scoring_fails_clearly_without_published_features(tmp_path):
    with pytest.raises(storage.PartitionNotPublishedError, match="features/ds=2026-01-05 is not published"):
        scoring.run(None, str(tmp_path), "2026-01-05", str(tmp_path / "m.pt"), "v1")


def test_scoring_refuses_an_empty_model_version(tmp_path):
    with pytest.raises(ValueError, match="model_version"):
        scoring.run(None, str(tmp_path), "2026-01-05", str(tmp_path / "m.pt"), "  ")
