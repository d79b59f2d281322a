"""Pieces of the scoring job that need no Spark: the per-worker model cache, the batch scorer, the checks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "jobs"))
from hybridjobs import scoring, storage  # noqa: E402


def save_model(path: Path, n_features: int, out_features: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_features, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, out_features), torch.nn.Sigmoid()).eval()
    torch.jit.script(model).save(str(path))
    return model


def test_score_frames_uses_the_manifest_order_not_the_frame_order(tmp_path):
    model = save_model(tmp_path / "m.pt", 3)
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"c": rng.normal(size=5), "customer_id": list("abcde"), "a": rng.normal(size=5),
                          "b": rng.normal(size=5)}).astype({"a": "float32", "b": "float32", "c": "float32"})
    (out,) = scoring.score_frames(iter([frame]), str(tmp_path / "m.pt"), ("a", "b", "c"))
    expected = model(torch.from_numpy(frame[["a", "b", "c"]].to_numpy())).detach().numpy().reshape(-1)
    assert list(out.columns) == ["customer_id", "score"]
    assert out["customer_id"].tolist() == list("abcde")
    assert out["score"].dtype == np.float32
    np.testing.assert_allclose(out["score"].to_numpy(), expected, rtol=1e-6)


def test_model_is_loaded_once_per_process_and_path(tmp_path):
    save_model(tmp_path / "m.pt", 2)
    first = scoring.load_model(str(tmp_path / "m.pt"))
    assert scoring.load_model(str(tmp_path / "m.pt")) is first
    assert torch.get_num_threads() == 1


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


@pytest.mark.parametrize("total_bytes, parallelism, expected_mib", [
    (0, 2, 4),
    (40 << 20, 2, 10),
    (10 << 30, 2, 128),
    (100 << 20, 0, 50),
])
def test_split_bytes(total_bytes, parallelism, expected_mib):
    assert scoring.split_bytes(total_bytes, parallelism) == expected_mib << 20
