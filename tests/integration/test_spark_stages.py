"""The Spark stages on real Spark, run the way Airflow runs them: `spark-submit jobs/<name>.py ...`.

raw (generator) -> features + quarantine -> quality gate -> scoring, on local[2] with a tmp storage root, plus
an idempotent rerun, hand-made malformed rows, a deliberately drifted schema, and one run on the standalone
master (which fails, naming what is missing, when the master or its worker is not up: the stack provides both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers.partitions import manifest, read
from helpers.spark import (
    CUSTOMERS,
    DS,
    DS_PREV,
    RAW_NAMES,
    ROWS,
    STANDALONE_MASTER,
    generate,
    require_standalone_master,
    spark_submit,
)
from hybridflow.exceptions import DataQualityError
from hybridflow.pipeline import quality
from hybridjobs.features import FEATURE_COLUMNS, QUARANTINE_REASONS

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "jobs"


def build_features(root: Path, ds: str, *extra: str, master: str = "local[2]") -> str:
    return spark_submit(str(JOBS / "build_features.py"), "--root", str(root), "--ds", ds, *extra,
                        master=master)


def score(root: Path, ds: str, model: Path, version: str, master: str = "local[2]") -> str:
    return spark_submit(str(JOBS / "score_batch.py"), "--root", str(root), "--ds", ds, "--model", str(model),
                        "--model-version", version, master=master)


def save_model(path: Path, n_features: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1),
                                torch.nn.Sigmoid()).eval()
    torch.jit.script(model).save(str(path))
    return model


def output_line(stdout: str, prefix: str) -> dict[str, str]:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(prefix + " ")]
    return dict(item.split("=", 1) for item in line.split()[1:])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    raw_prev = generate(root, DS_PREV)
    raw = generate(root, DS)
    features_out = build_features(root, DS)
    model_path = root / "model.pt"
    model = save_model(model_path, len(FEATURE_COLUMNS))
    scoring_out = score(root, DS, model_path, "v1")
    return {
        "root": root, "model": model, "model_path": model_path, "raw": raw, "raw_prev": raw_prev,
        "features_out": features_out, "scoring_out": scoring_out,
        "features": read(root, "features", DS).sort_by("customer_id"),
        "predictions": read(root, "predictions", DS).sort_by("customer_id"),
        "quarantine": read(root, "quarantine", DS).sort_by("event_id"),
        "manifests": {d: manifest(root, d, DS) for d in ("features", "quarantine", "predictions")},
    }


def test_spark_pipeline_raw_to_features_gate_to_predictions(pipeline):
    import torch

    features, predictions = pipeline["features"], pipeline["predictions"]
    fm = pipeline["manifests"]["features"]
    assert fm["input"]["lookback_partitions"] == [DS_PREV, DS]
    assert fm["row_count"] == features.num_rows
    assert 0.9 * CUSTOMERS < features.num_rows <= CUSTOMERS
    assert len(pc.unique(features["customer_id"])) == features.num_rows
    assert features.column_names == ["customer_id", "label", *FEATURE_COLUMNS]
    assert [str(t) for t in features.schema.types[:3]] == ["string", "int32", "float"]
    assert fm["feature_columns"] == list(FEATURE_COLUMNS)
    assert fm["label_rate"] == pytest.approx(pc.mean(features["label"]).as_py(), abs=1e-6)

    results = quality.gate(fm, None, quality.load_contract())
    assert quality.summary(results)["failed"] == 0

    assert predictions.column_names == ["customer_id", "score", "model_version"]
    assert predictions["customer_id"].equals(features["customer_id"])
    assert pc.all(pc.equal(predictions["model_version"], "v1")).as_py()
    inputs = np.stack([features[c].to_numpy() for c in fm["feature_columns"]], axis=1)
    expected = pipeline["model"](torch.from_numpy(inputs)).detach().numpy().reshape(-1)
    np.testing.assert_allclose(predictions["score"].to_numpy(), expected, rtol=1e-5, atol=1e-6)

    pm = pipeline["manifests"]["predictions"]
    assert pm["row_count"] == fm["row_count"]
    assert pm["model"]["version"] == "v1" and len(pm["model"]["sha256"]) == 64
    printed = output_line(pipeline["scoring_out"], "SCORING")
    assert int(printed["rows"]) == fm["row_count"] and float(printed["rows_per_s"]) > 0
    assert output_line(pipeline["features_out"], "FEATURES")["quarantined"] == str(fm["quarantine"]["rows"])


def test_spark_quarantine_counts_per_reason_match_planted_truth(pipeline):
    planted = pipeline["raw"]["planted_defects"]
    quarantine = pipeline["quarantine"]
    fm, qm = pipeline["manifests"]["features"], pipeline["manifests"]["quarantine"]
    counted = {r["reason"]: r["reason_count"] for r in quarantine.group_by("reason").aggregate(
        [("reason", "count")]).to_pylist()}
    assert set(planted) == set(QUARANTINE_REASONS)
    assert {k: counted.get(k, 0) for k in planted} == planted
    assert fm["quarantine"]["by_reason"] == planted == qm["by_reason"]
    assert fm["quarantine"]["rows"] == qm["row_count"] == sum(planted.values())
    assert fm["quarantine"]["ratio"] == pytest.approx(sum(planted.values()) / ROWS)
    assert fm["input"]["raw_rows"] == ROWS
    assert fm["input"]["valid_rows"] == ROWS - sum(planted.values())

    # Quarantined rows keep their original bytes.
    raw = read_raw_events(pipeline["root"], DS)
    original = raw.filter(pc.is_in(raw["event_id"], value_set=quarantine["event_id"])).sort_by("event_id")
    assert original.num_rows == quarantine.num_rows
    assert original.equals(quarantine.drop_columns(["reason"]).select(original.column_names))


def read_raw_events(root: Path, ds: str) -> pa.Table:
    return pq.read_table(root / "raw" / f"ds={ds}" / "events")


def test_spark_rerun_of_a_ds_replaces_partitions_without_duplicates(pipeline):
    root = pipeline["root"]
    before = pipeline["manifests"]
    build_features(root, DS)
    score(root, DS, pipeline["model_path"], "v1")
    after = {d: manifest(root, d, DS) for d in ("features", "quarantine", "predictions")}

    for dataset in ("features", "quarantine", "predictions"):
        assert after[dataset]["row_count"] == before[dataset]["row_count"], dataset
        assert after[dataset]["job"]["spark_app_id"] != before[dataset]["job"]["spark_app_id"], \
            "did not rerun"
        assert sorted(p.name for p in (root / dataset).iterdir()) == [f"ds={DS}"], "leftover staging or dupes"
        files = sorted(p.name for p in (root / dataset / f"ds={DS}").glob("*.parquet"))
        assert files == after[dataset]["files"]
    assert read(root, "features", DS).sort_by("customer_id").equals(pipeline["features"])
    assert read(root, "predictions", DS).sort_by("customer_id").equals(pipeline["predictions"])
    assert read(root, "quarantine", DS).sort_by("event_id").equals(pipeline["quarantine"])


# Hand-made raw rows: event_id says which quarantine reason the row must get ("ok" = none).
CRAFTED = [
    ("ok-1", b"C1", b"2026-01-05T10:00:00Z", b"purchase", b"10.50", b"app", b"mobile", b"DE"),
    ("ok-2", b" C1 ", b"2026-01-05T22:00:00Z", b"view", None, b"web", b"desktop", b"DE"),
    ("ok-3", b"C1", b"2026-01-04T23:59:59Z", b"purchase", b"5", b"store", b"mobile", b"DE"),
    ("ok-4", b"C2", b"2026-01-05T23:59:59Z", b"add_to_cart", b"", b"email", b"tablet", b"XX"),
    ("ok-5", b"C2", b"2026-01-05T00:00:00Z", b"click", None, b"web", b"mobile", b"XX"),
    ("invalid_utf8-1", b"C\xff", b"2026-01-05T10:00:00Z", b"view", None, b"web", b"mobile", b"DE"),
    ("invalid_utf8-2", b"C3", b"2026-01-05T10:00:00Z", b"view", None, b"web", b"mobile", b"\xc3\x28"),
    ("invalid_utf8-3", b"\xff", None, b"view", None, b"web", b"mobile", b"DE"),
    ("missing_customer_id-1", None, b"2026-01-05T10:00:00Z", b"view", None, b"web", b"mobile", b"DE"),
    ("missing_customer_id-2", b"   ", b"2026-01-05T10:00:00Z", b"view", None, b"web", b"mobile", b"DE"),
    ("missing_customer_id-3", b"", b"not a time", b"Purchase", b"-1", b"web", b"mobile", b"DE"),
    ("bad_timestamp-1", b"C3", b"2026/01/05 10:00", b"view", None, b"web", b"mobile", b"DE"),
    ("bad_timestamp-2", b"C3", None, b"view", None, b"web", b"mobile", b"DE"),
    ("bad_timestamp-3", b"C3", b"2026-02-30T10:00:00Z", b"view", None, b"web", b"mobile", b"DE"),
    ("future_timestamp-1", b"C3", b"2026-01-06T00:00:00Z", b"view", None, b"web", b"mobile", b"DE"),
    ("future_timestamp-2", b"C3", b"2027-01-01T00:00:00Z", b"purchase", b"abc", b"web", b"mobile", b"DE"),
    ("unknown_event_type-1", b"C3", b"2026-01-05T10:00:00Z", b"Purchase", b"1", b"web", b"mobile", b"DE"),
    ("unknown_event_type-2", b"C3", b"2026-01-05T10:00:00Z", None, None, b"web", b"mobile", b"DE"),
    ("bad_amount_type-1", b"C3", b"2026-01-05T10:00:00Z", b"purchase", b"12,50", b"web", b"mobile", b"DE"),
    ("bad_amount_type-2", b"C3", b"2026-01-05T10:00:00Z", b"purchase", b"NaN", b"web", b"mobile", b"DE"),
    ("bad_amount_type-3", b"C3", b"2026-01-05T10:00:00Z", b"purchase", b"-Infinity", b"web", b"mobile",
     b"DE"),
    ("negative_amount-1", b"C3", b"2026-01-05T10:00:00Z", b"purchase", b"-0.01", b"web", b"mobile", b"DE"),
]


def write_crafted_raw(root: Path, ds: str) -> None:
    part = root / "raw" / f"ds={ds}"
    (part / "events").mkdir(parents=True)
    (part / "labels").mkdir()
    rows = [(r[0].encode(), *r[1:]) for r in CRAFTED]
    table = pa.table({name: pa.array([r[i] for r in rows], pa.binary()) for i, name in enumerate(RAW_NAMES)})
    pq.write_table(table, part / "events" / "part-00000.parquet")
    pq.write_table(pa.table({"customer_id": ["C1", "C2", "C3"], "label": pa.array([1, 0, 0], pa.int32())}),
                   part / "labels" / "part-00000.parquet")
    (part / "_MANIFEST.json").write_text(json.dumps({"dataset": "raw", "ds": ds, "row_count": len(rows)}))
    (part / "_SUCCESS").write_text("")


def test_spark_crafted_rows_get_their_reason_and_exact_features(tmp_path):
    write_crafted_raw(tmp_path, DS)
    build_features(tmp_path, DS, "--lookback-days", "1")

    quarantine = read(tmp_path, "quarantine", DS)
    got = {e.decode(): r for e, r in zip(quarantine["event_id"].to_pylist(), quarantine["reason"].to_pylist(),
                                         strict=True)}
    want = {r[0]: r[0].rsplit("-", 1)[0] for r in CRAFTED if not r[0].startswith("ok-")}
    assert got == want

    fm = manifest(tmp_path, "features", DS)
    assert fm["input"]["raw_rows"] == len(CRAFTED) and fm["quarantine"]["rows"] == len(want)
    rows = {r["customer_id"]: r for r in read(tmp_path, "features", DS).to_pylist()}
    assert sorted(rows) == ["C1", "C2"]  # C3 has only quarantined rows
    day = 86400.0
    expected = {
        "C1": {"label": 1, "log_events_1d": math.log1p(2), "log_events_7d": math.log1p(3),
               "log_purchases_1d": math.log1p(1), "log_purchases_28d": math.log1p(2),
               "log_spend_7d": math.log1p(15.5), "log_avg_purchase_amount_28d": math.log1p(7.75),
               "log_max_amount_28d": math.log1p(10.5), "active_days_28d": 2, "recency_days": 7200 / day,
               "purchase_recency_days": 50400 / day, "purchase_per_view_28d": 1.0,
               "cart_to_purchase_28d": 2.0,
               "support_share_28d": 0.0, "share_web_28d": 1 / 3, "share_app_28d": 1 / 3,
               "share_store_28d": 1 / 3, "share_email_28d": 0.0, "share_mobile_28d": 2 / 3,
               "share_desktop_28d": 1 / 3, "share_tablet_28d": 0.0, "country_DE": 1.0, "country_other": 0.0},
        "C2": {"label": 0, "log_events_1d": math.log1p(2), "log_purchases_7d": 0.0, "log_spend_28d": 0.0,
               "log_avg_purchase_amount_28d": 0.0, "log_max_amount_28d": 0.0, "active_days_28d": 1,
               "recency_days": 1 / day, "purchase_recency_days": 29.0, "cart_to_purchase_28d": 0.0,
               "share_email_28d": 0.5, "share_web_28d": 0.5, "share_tablet_28d": 0.5, "share_mobile_28d": 0.5,
               "country_US": 0.0, "country_other": 1.0},
    }
    for customer, values in expected.items():
        for name, value in values.items():
            assert rows[customer][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (customer, name)


# spark-submit runs this file from a tmp dir, alone: it puts the jobs folder on its own path to import the job.
DRIFTED_JOB = '''
import sys
sys.path.insert(0, {jobs!r})
from pyspark.sql import functions as F
from hybridjobs import features
import build_features

# A changed job version: one feature computed as double, one dropped, without touching the declared contract.
original = features.customer_features
features.customer_features = lambda classified, as_of: (
    original(classified, as_of).withColumn("recency_days", F.col("recency_days").cast("double"))
    .drop("share_email_28d"))
features.FEATURE_COLUMNS = tuple(c for c in features.FEATURE_COLUMNS if c != "share_email_28d")
features.OUTPUT_COLUMNS = ("customer_id", "label", *features.FEATURE_COLUMNS)
sys.exit(build_features.main(sys.argv[1:]))
'''


def test_spark_quality_gate_fails_on_a_drifted_schema(tmp_path):
    generate(tmp_path, DS, rows=5_000, customers=400)
    script = tmp_path / "drifted_build_features.py"
    script.write_text(DRIFTED_JOB.format(jobs=str(JOBS)))
    spark_submit(str(script), "--root", str(tmp_path), "--ds", DS, "--lookback-days", "1")
    drifted = manifest(tmp_path, "features", DS)

    with pytest.raises(DataQualityError) as caught:
        quality.gate(drifted, None, quality.load_contract())
    text = str(caught.value)
    assert text.startswith(f"data quality gate failed for features ds={DS}: 3 of ")
    assert "  - schema.type column=recency_days: observed float64, expected float32" in text
    assert "  - schema.missing_column column=share_email_28d: observed absent, expected float32" in text
    assert ("  - schema.feature_order column=share_mobile_28d: observed feature_columns[19]=share_mobile_28d "
            "(29 features), expected feature_columns[19]=share_email_28d (30 features)") in text
    assert text.endswith("Runbook: include/runbooks/data-quality.md")
    assert (REPO / "include" / "runbooks" / "data-quality.md").is_file()


def test_spark_standalone_master_runs_features_and_scoring(cluster_tmp_path):
    require_standalone_master()
    generate(cluster_tmp_path, DS, rows=5_000, customers=400)
    build_features(cluster_tmp_path, DS, "--lookback-days", "1", master=STANDALONE_MASTER)
    model_path = cluster_tmp_path / "model.pt"
    save_model(model_path, len(FEATURE_COLUMNS))
    score(cluster_tmp_path, DS, model_path, "standalone-1", master=STANDALONE_MASTER)

    fm, pm = manifest(cluster_tmp_path, "features", DS), manifest(cluster_tmp_path, "predictions", DS)
    assert fm["job"]["spark_master"] == pm["job"]["spark_master"] == STANDALONE_MASTER
    assert fm["quarantine"]["by_reason"] == manifest(cluster_tmp_path, "raw", DS)["planted_defects"]
    assert pm["row_count"] == fm["row_count"] > 0
    predictions = read(cluster_tmp_path, "predictions", DS)
    assert pc.all(pc.equal(predictions["model_version"], "standalone-1")).as_py()
