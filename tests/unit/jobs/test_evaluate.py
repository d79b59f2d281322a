"""jobs/evaluate.py: the champion/challenger evaluation on the training job's holdout, each model loaded once, its
time split into phases."""

from __future__ import annotations

import hashlib
from pathlib import Path

import evaluate
import numpy as np
import pyarrow.parquet as pq
import torch
from helpers.feature_partitions import FEATURES, write_features
from hybridtrain.config import ModelSpec
from hybridtrain.evaluation import roc_auc
from hybridtrain.export import SMOKE_ROWS, export_model
from hybridtrain.model import build_network

DAYS = ("2026-01-01", "2026-01-02")
SPEC = ModelSpec(hidden_sizes=(8,), dropout=0.0)


def export(directory: Path, seed: int) -> str:
    torch.manual_seed(seed)
    raw = np.random.default_rng(seed).normal(size=(SMOKE_ROWS, len(FEATURES))).astype(np.float32)
    exported = export_model(build_network(len(FEATURES), SPEC).state_dict(), spec=SPEC,
                            mean=np.zeros(len(FEATURES), np.float32), std=np.ones(len(FEATURES), np.float32),
                            feature_columns=tuple(FEATURES), smoke_inputs=raw, export_dir=directory / "export",
                            details={})
    return exported["model"]


def test_evaluate_loads_each_model_once_scores_the_holdout_rule_and_times_its_phases(tmp_path, monkeypatch):
    for seed, ds in enumerate(DAYS):
        write_features(tmp_path / "features", ds, seed=seed, customers=1500)
    challenger, champion = export(tmp_path / "a", seed=0), export(tmp_path / "b", seed=1)
    loaded = []
    load = torch.jit.load
    monkeypatch.setattr(torch.jit, "load", lambda path, **kwargs: loaded.append(path) or load(path, **kwargs))

    pair = evaluate.evaluate(str(tmp_path / "features"), DAYS, challenger, champion, 0.2)
    alone = evaluate.evaluate(str(tmp_path / "features"), DAYS, challenger, challenger, 0.2)

    assert loaded == [challenger, champion, challenger], "one load per model file, a champion that is it too"
    assert set(pair["phases_s"]) == {"read", "hash", "load", "score", "metrics"}
    assert all(seconds >= 0 for seconds in pair["phases_s"].values())
    # the holdout is HOLDOUT_RULE's, and the figures are each model's own on it
    tables = [pq.read_table(tmp_path / "features" / f"ds={ds}").sort_by("customer_id") for ds in DAYS]
    ids = [i for table in tables for i in table.column("customer_id").to_pylist()]
    holdout = np.array([int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big") % 10_000 < 2_000
                        for i in ids])
    rows = np.concatenate([np.stack([t.column(f).to_numpy() for f in FEATURES], axis=1) for t in tables])[holdout]
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])[holdout]
    assert pair["holdout_rows"] == holdout.sum() > 0
    for result, path in ((pair["challenger"], challenger), (pair["champion"], champion)):
        scores = torch.jit.load(path)(torch.from_numpy(rows.astype(np.float32))).detach().numpy().reshape(-1)
        assert result["model"] == path and result["auc"] == roc_auc(labels, scores)
    assert pair["challenger"]["auc"] != pair["champion"]["auc"]
    assert alone["champion"] == alone["challenger"] == pair["challenger"]
