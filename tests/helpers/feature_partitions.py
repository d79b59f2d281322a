"""Synthetic published feature partitions, as the Spark features job leaves them, for the Slurm training tests
and the training benchmark: Parquet, ``_MANIFEST.json``, then ``_SUCCESS``, with a planted signal in the first
two features so a trained model's holdout AUC is measurable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = ["spend_30d", "visits_7d", "basket_mean", "discount_share"]


def write_features(root: Path, ds: str, seed: int, customers: int = 1200) -> None:
    """One published features partition ``root/ds=<ds>`` of ``customers`` rows, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(customers, len(FEATURES)))
    labels = (rng.random(customers) < 1 / (1 + np.exp(-(1.8 * x[:, 0] - 1.2 * x[:, 1])))).astype(np.int32)
    table = pa.table({"customer_id": [f"c{seed}-{i}" for i in range(customers)], "label": labels}
                     | {name: x[:, i].astype(np.float32) for i, name in enumerate(FEATURES)})
    directory = root / f"ds={ds}"
    directory.mkdir(parents=True)
    pq.write_table(table, directory / "part-00000.parquet")
    (directory / "_MANIFEST.json").write_text(json.dumps({"feature_columns": FEATURES, "ds": ds,
                                                         "row_count": customers}))
    (directory / "_SUCCESS").write_text("")
