"""The raw-data generator (hybridjobs.generator): deterministic, skewed, with a learnable label and exactly
the defects it says it planted. A reference classifier in plain Python checks every row, independently of
Spark."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hybridjobs import generator
from hybridjobs.generator import DEFECT_KINDS, GeneratorConfig

DS = "2026-01-05"


def reference_reason(row: dict, partition_end: datetime) -> str | None:
    """What the features job must decide for a raw row, written independently in plain Python."""
    for value in row.values():
        if value is not None:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return "invalid_utf8"
    text = {k: (v.decode() if v is not None else None) for k, v in row.items()}
    if not (text["customer_id"] or "").strip():
        return "missing_customer_id"
    try:
        ts = datetime.strptime(text["event_ts"] or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return "bad_timestamp"
    if ts >= partition_end:
        return "future_timestamp"
    if text["event_type"] not in generator.EVENT_TYPES:
        return "unknown_event_type"
    amount = (text["amount"] or "").strip()
    if amount:
        try:
            value = float(amount)
        except ValueError:
            return "bad_amount_type"
        if not math.isfinite(value) or amount.lower() in ("nan", "infinity", "-infinity"):
            return "bad_amount_type"
        if value < 0:
            return "negative_amount"
    return None


@pytest.fixture(scope="module")
def chunk():
    config = GeneratorConfig(rows=30_000, customers=2_000, malformed_share=0.05)
    pop = generator.make_population(config.n_customers, config.population_seed)
    table, counts = generator.make_events_chunk(pop, DS, 0, config.rows, 0, config)
    return config, pop, table, counts


def test_generator_is_deterministic_per_ds_and_differs_between_days(chunk):
    config, pop, table, counts = chunk
    again, again_counts = generator.make_events_chunk(pop, DS, 0, config.rows, 0, config)
    assert again.equals(table) and again_counts == counts
    other, _ = generator.make_events_chunk(pop, "2026-01-06", 0, config.rows, 0, config)
    assert not other.column("customer_id").equals(table.column("customer_id"))


def test_generator_columns_are_all_binary(chunk):
    _, _, table, _ = chunk
    assert table.column_names == list(generator.RAW_COLUMNS)
    assert {str(t) for t in table.schema.types} == {"binary"}


def test_generator_planted_defects_match_a_row_by_row_reference(chunk):
    config, _, table, counts = chunk
    end = datetime(2026, 1, 6, tzinfo=UTC)
    found = dict.fromkeys(DEFECT_KINDS, 0)
    for row in table.to_pylist():
        reason = reference_reason(row, end)
        if reason:
            found[reason] += 1
    assert found == counts
    assert sum(counts.values()) == round(config.rows * config.malformed_share)
    assert all(n > 0 for n in counts.values())


def test_generator_defect_weights_shape_the_mix():
    config = GeneratorConfig(rows=10_000, customers=500, malformed_share=0.1,
                             defect_weights=generator.parse_defect_weights(
                                 ",".join(f"{k}=0" for k in DEFECT_KINDS if k != "negative_amount")))
    pop = generator.make_population(config.n_customers, config.population_seed)
    _, counts = generator.make_events_chunk(pop, DS, 0, config.rows, 0, config)
    assert counts["negative_amount"] == 1_000
    assert sum(counts.values()) == 1_000


def test_generator_activity_is_skewed(chunk):
    _, _, table, _ = chunk
    counts = pc.value_counts(table.column("customer_id").drop_null()).field("counts").to_numpy()
    per_customer = np.sort(counts)[::-1]
    assert per_customer[0] > 10 * np.median(per_customer)
    assert per_customer[0] < 0.05 * per_customer.sum()


def test_generator_label_is_learnable_from_behaviour(chunk):
    """Customers who convert buy more often and use the app more: the signal reaches observable events."""
    _, pop, table, _ = chunk
    labels = generator.make_labels(pop, DS, 7).column("label").to_numpy()
    assert 0.1 < labels.mean() < 0.4
    cust = np.array([int(c[1:]) - 1 if c and c[1:].isdigit() else -1
                     for c in (v.decode("utf-8", "replace").strip() if v else "" for v in
                               table.column("customer_id").to_pylist())])
    types = np.array([v for v in table.column("event_type").to_pylist()], dtype=object)
    ok = cust >= 0
    purchase = (types == b"purchase")[ok]
    row_label = labels[cust[ok]]
    assert purchase[row_label == 1].mean() > 1.3 * purchase[row_label == 0].mean()


def test_generate_partition_writes_events_labels_and_truth(tmp_path):
    config = GeneratorConfig(rows=2_500, customers=300, rows_per_file=1_000)
    details = generator.generate_partition(tmp_path / "p", DS, config)
    files = sorted(p.name for p in (tmp_path / "p" / "events").iterdir())
    assert files == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert pq.read_table(tmp_path / "p" / "events").num_rows == 2_500
    labels = pq.read_table(tmp_path / "p" / "labels")
    assert labels.num_rows == 300 and str(labels.schema.field("label").type) == "int32"
    assert details["planted_defects_total"] == sum(details["planted_defects"].values()) == 50
    assert details["generator"]["customers"] == 300


@pytest.mark.parametrize("kwargs, message", [
    ({"rows": 0}, "rows"),
    ({"rows": 10, "customers": 0}, "customers"),
    ({"rows": 10, "malformed_share": 1.5}, "malformed_share"),
    ({"rows": 10, "defect_weights": {"typo": 1.0}}, "unknown defect kinds"),
    ({"rows": 10, "defect_weights": {"bad_timestamp": 0.0}}, "not all zero"),
    ({"rows": 10, "rows_per_file": 0}, "rows_per_file"),
])
def test_generator_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GeneratorConfig(**kwargs)


@pytest.mark.parametrize("text, expected", [
    (None, {k: 1.0 for k in DEFECT_KINDS}),
    ("bad_amount_type=2", {**{k: 1.0 for k in DEFECT_KINDS}, "bad_amount_type": 2.0}),
    ("negative_amount=0, invalid_utf8=3", {**{k: 1.0 for k in DEFECT_KINDS}, "negative_amount": 0.0,
                                           "invalid_utf8": 3.0}),
])
def test_parse_defect_weights(text, expected):
    assert generator.parse_defect_weights(text) == expected


@pytest.mark.parametrize("text", ["bad_amount_type", "nope=1", "=2"])
def test_parse_defect_weights_rejects(text):
    with pytest.raises(ValueError, match="kind=weight"):
        generator.parse_defect_weights(text)


def test_default_population_scales_with_rows():
    assert GeneratorConfig(rows=1_000_000).n_customers == 50_000
    assert GeneratorConfig(rows=100).n_customers == 200
