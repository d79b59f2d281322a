"""Reading the features job's partitions for training: the contract is checked, errors name the place."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridtrain.errors import FeatureDataError
from hybridtrain.features import HOLDOUT_BUCKETS, holdout_mask, read_feature_partitions

COLUMNS = ["spend_30d", "visits_7d"]


def write_partition(
    root: Path,
    ds: str,
    parts: list[dict],
    *,
    columns: list[str] = COLUMNS,
    success: bool = True,
    manifest: object = None,
) -> Path:
    directory = root / f"ds={ds}"
    directory.mkdir(parents=True)
    for index, rows in enumerate(parts):
        pq.write_table(pa.table(rows), directory / f"part-{index:05d}-abc.snappy.parquet")
    (directory / "part-00000-abc.snappy.parquet.crc").write_bytes(b"crc")
    (directory / "_MANIFEST.json").write_text(json.dumps(manifest or {"feature_columns": columns, "rows": 3}))
    if success:
        (directory / "_SUCCESS").write_text("")
    return directory


def rows(ids: list[str], labels: list[int], spend: list[float], visits: list[int]) -> dict:
    return {
        "customer_id": pa.array(ids, pa.string()),
        "label": pa.array(labels, pa.int32()),
        "spend_30d": pa.array(spend, pa.float64()),
        "visits_7d": pa.array(visits, pa.int64()),
    }


def test_training_reads_partitions_in_ds_and_customer_order(tmp_path):
    write_partition(tmp_path, "2026-01-02", [rows(["c3", "c1"], [1, 0], [3.5, 1.5], [3, 1])])
    write_partition(
        tmp_path,
        "2026-01-01",
        [rows(["c2"], [0], [2.0], [2]), rows(["c1", "c0"], [1, 0], [1.0, 0.5], [1, 0])],
    )
    data = read_feature_partitions(str(tmp_path), ("2026-01-01", "2026-01-02"))
    assert data.feature_columns == ("spend_30d", "visits_7d")
    assert data.customer_ids.to_pylist() == ["c0", "c1", "c2", "c1", "c3"]
    assert data.labels.tolist() == [0, 1, 0, 0, 1]
    assert data.features.dtype == np.float32
    assert data.features.tolist() == [[0.5, 0], [1.0, 1], [2.0, 2], [1.5, 1], [3.5, 3]]
    assert data.rows_per_partition == {"2026-01-01": 3, "2026-01-02": 2}
    assert len(data) == 5


def test_training_reads_only_manifest_columns_in_manifest_order(tmp_path):
    extra = rows(["c1"], [1], [1.0], [7]) | {"other": pa.array(["x"])}
    write_partition(tmp_path, "2026-01-01", [extra], columns=["visits_7d", "spend_30d"])
    data = read_feature_partitions(str(tmp_path), ("2026-01-01",))
    assert data.feature_columns == ("visits_7d", "spend_30d")
    assert data.features.tolist() == [[7.0, 1.0]]


def test_training_accepts_a_file_uri(tmp_path):
    write_partition(tmp_path, "2026-01-01", [rows(["c1"], [1], [1.0], [7])])
    assert len(read_feature_partitions(tmp_path.as_uri(), ("2026-01-01",))) == 1


GOOD = rows(["c1", "c2"], [1, 0], [1.0, 2.0], [1, 2])


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: None, "feature partition {root}/ds=2026-01-01 does not exist"),
        (lambda root: write_partition(root, "2026-01-01", [GOOD], success=False), "has no _SUCCESS"),
        (
            lambda root: (write_partition(root, "2026-01-01", [GOOD]) / "_MANIFEST.json").unlink(),
            "has no _MANIFEST.json",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD], manifest={"columns": COLUMNS}),
            "feature_columns must be a non-empty list",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD], columns=["label", "spend_30d"]),
            "other than customer_id and label",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD], columns=["spend_30d", "tenure"]),
            "part-00000-abc.snappy.parquet lacks columns ['tenure']",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD | {"spend_30d": pa.array(["a", "b"])}]),
            "feature column spend_30d must be numeric, got string",
        ),
        (
            lambda root: write_partition(
                root, "2026-01-01", [GOOD | {"label": pa.array([1, 2], pa.int32())}]
            ),
            "label holds values other than 0 and 1",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD | {"label": pa.array([0.0, 1.0])}]),
            "label must be an integer 0/1 column, got double",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD | {"customer_id": pa.array([1, 2])}]),
            "customer_id must be a string column",
        ),
        (
            lambda root: write_partition(
                root, "2026-01-01", [GOOD | {"visits_7d": pa.array([1, None], pa.int64())}]
            ),
            "column visits_7d has 1 null values",
        ),
        (
            lambda root: write_partition(
                root, "2026-01-01", [GOOD | {"spend_30d": pa.array([1.0, float("nan")])}]
            ),
            "1 rows have NaN or infinite values (columns ['spend_30d'])",
        ),
        (
            lambda root: write_partition(root, "2026-01-01", [GOOD | {"spend_30d": pa.array([1.0, 1e300])}]),
            "1 rows have NaN or infinite values (columns ['spend_30d'])",
        ),
        (lambda root: write_partition(root, "2026-01-01", []), "hold no rows"),
    ],
    ids=[
        "missing-partition",
        "no-success-marker",
        "no-manifest",
        "manifest-without-feature-columns",
        "label-as-feature",
        "missing-column",
        "string-feature",
        "label-not-binary",
        "float-label",
        "numeric-customer-id",
        "null-feature",
        "nan-feature",
        "overflows-float32",
        "no-rows",
    ],
)
def test_training_feature_partition_errors(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(FeatureDataError) as raised:
        read_feature_partitions(str(tmp_path), ("2026-01-01",))
    assert message.format(root=tmp_path) in str(raised.value)


def test_training_partitions_must_share_feature_columns(tmp_path):
    write_partition(tmp_path, "2026-01-01", [GOOD])
    write_partition(tmp_path, "2026-01-02", [GOOD], columns=["visits_7d", "spend_30d"])
    with pytest.raises(FeatureDataError, match=r"ds=2026-01-02/_MANIFEST.json lists feature_columns"):
        read_feature_partitions(str(tmp_path), ("2026-01-01", "2026-01-02"))


def test_training_holdout_is_a_stable_hash_of_customer_id():
    ids = np.array([f"cust-{i:06d}" for i in range(20_000)], dtype=object)
    mask = holdout_mask(ids, 0.2)
    assert abs(mask.mean() - 0.2) < 0.01
    assert np.array_equal(mask, holdout_mask(ids[::-1], 0.2)[::-1]), "a row's split does not depend on order"
    assert not (holdout_mask(ids, 0.1) & ~mask).any(), "a smaller holdout is a subset"
    # Pinned: the scoring and evaluation stages may reproduce the split; changing the rule breaks them.
    assert [i for i in range(12) if mask[i]] == PINNED_HOLDOUT_OF_FIRST_12


PINNED_HOLDOUT_OF_FIRST_12 = [7, 8]


def test_training_holdout_hash_is_the_rule_for_ids_of_any_length():
    """Hashed from Arrow's bytes: empty, multibyte, long ids and chunked or sliced arrays follow HOLDOUT_RULE."""
    rng = np.random.default_rng(3)
    alphabet = list("abcXYZ019-_é€😀")
    ids = ["", "c1", "é€😀", "w" * 300] + ["".join(rng.choice(alphabet, size=rng.integers(0, 40))) for _ in range(2000)]
    expected = np.array([int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "big") % HOLDOUT_BUCKETS
                         < 2000 for i in ids])
    chunked = pa.chunked_array([pa.array(ids[:1000], pa.large_string()), pa.array(ids[1000:], pa.large_string())])
    assert np.array_equal(holdout_mask(chunked, 0.2), expected)
    assert np.array_equal(holdout_mask(pa.array(ids, pa.string()).slice(3, 500), 0.2), expected[3:503])
    assert np.array_equal(holdout_mask(ids + ids[:50], 0.2), np.r_[expected, expected[:50]]), "repeated ids"


def publish(root: Path, ds: str, parts: list[dict]) -> Path:
    """A partition as the features job publishes it (hybridjobs.storage.publish): its manifest names each part
    with its bytes and sha256, and ``_SUCCESS`` names the manifest's sha256."""
    from hybridjobs import storage

    staging = root / f".ds={ds}.staging"
    staging.mkdir(parents=True)
    for index, table in enumerate(parts):
        pq.write_table(pa.table(table), staging / f"part-{index:05d}.parquet")
    storage.publish(staging, root / f"ds={ds}", {"feature_columns": COLUMNS, "ds": ds})
    return root / f"ds={ds}"


def test_training_reads_the_parts_the_manifest_names_never_a_stray_file(tmp_path):
    directory = publish(tmp_path, "2026-01-01", [GOOD, rows(["c3"], [1], [3.0], [3])])
    pq.write_table(pa.table(rows(["stray"], [0], [9.0], [9])), directory / "part-00009.parquet")
    data = read_feature_partitions(str(tmp_path), ("2026-01-01",))
    assert data.customer_ids.to_pylist() == ["c1", "c2", "c3"]


def replace_manifest(directory: Path, change) -> None:
    manifest = json.loads((directory / "_MANIFEST.json").read_text())
    change(manifest)
    (directory / "_MANIFEST.json").write_text(json.dumps(manifest))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def resign(directory: Path) -> None:
    """_SUCCESS naming the manifest as it now is (a consistent publish of what the test changed)."""
    body = (directory / "_MANIFEST.json").read_bytes()
    (directory / "_SUCCESS").write_text(json.dumps({"manifest_sha256": hashlib.sha256(body).hexdigest()}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: flip_last_byte(d / "part-00000.parquet"),
         "ds=2026-01-01/part-00000.parquet: {size} bytes that are not those the manifest names"),
        (lambda d: (d / "part-00000.parquet").write_bytes(b"PAR1"),
         "ds=2026-01-01/part-00000.parquet: 4 bytes that are not those the manifest names"),
        (lambda d: (d / "part-00000.parquet").unlink(), "part-00000.parquet is gone"),
        (lambda d: replace_manifest(d, lambda m: m.update(row_count=7)), "is not the one _SUCCESS names"),
        (lambda d: (replace_manifest(d, lambda m: m["parts"][0].update(key="../ds=2026-01-02/part-00000.parquet")),
                    resign(d)), "expected key, bytes and sha256"),
        (lambda d: (replace_manifest(d, lambda m: m["parts"][0].pop("sha256")), resign(d)),
         "expected key, bytes and sha256"),
        (lambda d: (replace_manifest(d, lambda m: m.update(parts="part-00000.parquet")), resign(d)),
         "parts is 'part-00000.parquet', expected a list"),
    ],
    ids=["flipped-byte", "truncated", "part-gone", "manifest-not-the-published-one", "key-outside-partition",
         "part-without-sha256", "parts-not-a-list"],
)
def test_training_refuses_a_partition_that_is_not_what_its_manifest_publishes(tmp_path, damage, message):
    directory = publish(tmp_path, "2026-01-01", [GOOD])
    size = (directory / "part-00000.parquet").stat().st_size
    damage(directory)
    with pytest.raises(FeatureDataError) as raised:
        read_feature_partitions(str(tmp_path), ("2026-01-01",))
    assert message.format(size=size) in str(raised.value)
