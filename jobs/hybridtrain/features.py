"""Reads the feature partitions the Spark features job published, and splits off the holdout.

A partition is ``<features_root>/ds=YYYY-MM-DD/`` holding Parquet parts, ``_SUCCESS`` (written last by the
features job) and ``_MANIFEST.json`` with ``"feature_columns"``: the ordered numeric columns the model reads.
Every row also has ``customer_id`` (string) and ``label`` (0 or 1). ``features_root`` is a local path or
``s3://bucket/prefix`` (credentials: hybridjobs/objectstore.py). The reader trusts the manifest, never a
listing: it reads the parts the manifest names, each checked against its size and sha256, and only a manifest
that ``_SUCCESS`` names (a partition published before manifests named their parts is read by listing its files).

Rows are ordered by (ds, customer_id) whatever the Parquet file layout, so rerunning the features job with a
different number of output files does not change the training data order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from operator import methodcaller

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from hybridjobs import objectstore
from hybridtrain.errors import FeatureDataError

__all__ = [
    "HOLDOUT_BUCKETS",
    "HOLDOUT_RULE",
    "FeatureSet",
    "holdout_mask",
    "partition_path",
    "read_feature_partitions",
    "standardization",
]

SUCCESS_MARKER = "_SUCCESS"
MANIFEST_NAME = "_MANIFEST.json"
ID_COLUMN = "customer_id"
LABEL_COLUMN = "label"
HOLDOUT_BUCKETS = 10_000
HOLDOUT_RULE = (
    "holdout when int.from_bytes(blake2b(customer_id UTF-8, digest_size=8), 'big') % 10000 "
    "< round(holdout_fraction * 10000)"
)


@dataclass(frozen=True)
class FeatureSet:
    """All rows of the requested partitions, in (ds, customer_id) order."""

    feature_columns: tuple[str, ...]
    features: np.ndarray
    labels: np.ndarray
    customer_ids: pa.ChunkedArray  # strings, kept in Arrow: hashed there for the holdout, never one by one
    rows_per_partition: dict[str, int]

    def __len__(self) -> int:
        return len(self.labels)


def partition_path(root: str, ds: str) -> str:
    return f"{root.rstrip('/')}/ds={ds}"


def read_feature_partitions(features_root: str, ds_values: tuple[str, ...]) -> FeatureSet:
    """Read and check every partition.

    :raises FeatureDataError: a partition is missing, has no ``_SUCCESS`` or manifest, the partitions disagree
        on the feature columns, a column is missing or not numeric, a value is null or not finite, a label is
        not 0/1, or there are no rows at all. The message names the partition and column.
    """
    try:
        location = objectstore.open_uri(features_root)
    except (objectstore.StorageError, pa.ArrowInvalid, OSError) as error:
        raise FeatureDataError(f"features_root {features_root!r} cannot be opened: {error}") from None
    filesystem, root = location.filesystem, location.path
    feature_columns: tuple[str, ...] | None = None
    tables = []
    rows_per_partition = {}
    for ds in ds_values:
        directory = partition_path(root, ds)
        where = partition_path(features_root, ds)
        manifest = _manifest(filesystem, directory, where)
        columns = _feature_columns(manifest, where)
        if feature_columns is None:
            feature_columns = columns
        elif columns != feature_columns:
            raise FeatureDataError(
                f"{where}/{MANIFEST_NAME} lists feature_columns {list(columns)}, but earlier partitions list "
                f"{list(feature_columns)}: train on partitions of one feature schema"
            )
        table = _read_partition(filesystem, directory, where, feature_columns, manifest.get("parts"))
        rows_per_partition[ds] = table.num_rows
        tables.append(table.sort_by([(ID_COLUMN, "ascending")]))
    assert feature_columns is not None
    table = pa.concat_tables(tables)
    if table.num_rows == 0:
        raise FeatureDataError(f"partitions {list(ds_values)} under {features_root} hold no rows")
    features = np.empty((table.num_rows, len(feature_columns)), dtype=np.float32)
    with np.errstate(over="ignore"):
        for index, name in enumerate(feature_columns):
            features[:, index] = table.column(name).to_numpy().astype(np.float32)
    bad_rows = ~np.isfinite(features).all(axis=1)
    if bad_rows.any():
        columns = [name for i, name in enumerate(feature_columns) if not np.isfinite(features[:, i]).all()]
        raise FeatureDataError(
            f"{int(bad_rows.sum())} rows have NaN or infinite values (columns {columns}) as float32; the "
            "features job's quality gate should have quarantined them"
        )
    return FeatureSet(
        feature_columns=feature_columns,
        features=features,
        labels=table.column(LABEL_COLUMN).to_numpy().astype(np.float32),
        customer_ids=table.column(ID_COLUMN),
        rows_per_partition=rows_per_partition,
    )


def holdout_mask(customer_ids: pa.Array | pa.ChunkedArray | Sequence[str], fraction: float) -> np.ndarray:
    """True for the rows of the holdout: a stable hash of ``customer_id`` (see ``HOLDOUT_RULE``), so a
    customer is in the same split on every day, in every run and in every process. Each distinct id is hashed
    once (a customer has a row per day), by hashlib driven from C (``map`` and ``bytes.join``: no Python code runs
    per id; a BLAKE2b written in numpy measured no faster).
    """
    if isinstance(customer_ids, pa.ChunkedArray):
        customer_ids = customer_ids.combine_chunks()
    elif not isinstance(customer_ids, pa.Array):
        customer_ids = pa.array(customer_ids, pa.string())
    encoded = pc.dictionary_encode(customer_ids)  # the distinct ids, and each row's among them, in one pass
    distinct = encoded.dictionary.cast(pa.large_binary()).to_pylist()  # UTF-8 bytes
    digests = b"".join(map(methodcaller("digest"), map(partial(hashlib.blake2b, digest_size=8), distinct)))
    holdout = np.frombuffer(digests, dtype=">u8") % HOLDOUT_BUCKETS < round(fraction * HOLDOUT_BUCKETS)
    return holdout[encoded.indices.to_numpy()]


def standardization(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and standard deviation (float64 sums); a constant column gets std 1."""
    mean = features.mean(axis=0, dtype=np.float64)
    std = features.std(axis=0, dtype=np.float64)
    return mean.astype(np.float32), np.where(std > 0, std, 1.0).astype(np.float32)


def _manifest(filesystem: pafs.FileSystem, directory: str, where: str) -> dict:
    """The partition's manifest, only if ``_SUCCESS`` publishes it."""
    info = filesystem.get_file_info(
        [directory, f"{directory}/{SUCCESS_MARKER}", f"{directory}/{MANIFEST_NAME}"]
    )
    if info[1].type != pafs.FileType.File:
        if info[0].type == pafs.FileType.NotFound:
            raise FeatureDataError(f"feature partition {where} does not exist: run the features job for that date")
        raise FeatureDataError(
            f"feature partition {where} has no {SUCCESS_MARKER}: the features job did not finish"
        )
    if info[2].type != pafs.FileType.File:
        raise FeatureDataError(f"feature partition {where} has no {MANIFEST_NAME}")
    success = _read_bytes(filesystem, f"{directory}/{SUCCESS_MARKER}", where)
    body = _read_bytes(filesystem, f"{directory}/{MANIFEST_NAME}", where)
    if success.strip() and _named_sha256(success) != hashlib.sha256(body).hexdigest():
        raise FeatureDataError(f"feature partition {where}: {MANIFEST_NAME} is not the one {SUCCESS_MARKER} names "
                               f"(the features job is publishing it again): retry once it has finished")
    try:
        manifest = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FeatureDataError(f"{where}/{MANIFEST_NAME} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise FeatureDataError(f"{where}/{MANIFEST_NAME} is not a JSON object")
    return manifest


def _named_sha256(success: bytes) -> str | None:
    """The manifest sha256 ``_SUCCESS`` names (None: not the protocol's)."""
    try:
        named = json.loads(success).get("manifest_sha256")
    except (ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def _read_bytes(filesystem: pafs.FileSystem, path: str, where: str) -> bytes:
    try:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except FileNotFoundError:
        raise FeatureDataError(f"feature partition {where}: {path.rsplit('/', 1)[-1]} is gone (the features job is "
                               f"publishing it again): retry once it has finished") from None
    except OSError as error:
        raise FeatureDataError(f"feature partition {where}: cannot read {path.rsplit('/', 1)[-1]}: {error}") from None


def _feature_columns(manifest: dict, where: str) -> tuple[str, ...]:
    columns = manifest.get("feature_columns")
    if (
        not isinstance(columns, list)
        or not columns
        or not all(isinstance(name, str) and name for name in columns)
        or len(set(columns)) != len(columns)
        or {ID_COLUMN, LABEL_COLUMN} & set(columns)
    ):
        raise FeatureDataError(
            f"{where}/{MANIFEST_NAME}: feature_columns must be a non-empty list of distinct column names "
            f"other than {ID_COLUMN} and {LABEL_COLUMN}, got {columns!r}"
        )
    return tuple(columns)


def _listed_files(filesystem: pafs.FileSystem, directory: str) -> list[str]:
    """A partition published before manifests named their parts: its visible Parquet files."""
    selector = pafs.FileSelector(directory, recursive=False)
    return sorted(
        entry.path
        for entry in filesystem.get_file_info(selector)
        if entry.type == pafs.FileType.File
        and entry.base_name.endswith(".parquet")
        and not entry.base_name.startswith(("_", "."))
    )


def _read_part(filesystem: pafs.FileSystem, directory: str, where: str, part: object) -> pa.Table:
    if not (isinstance(part, dict) and isinstance(part.get("key"), str) and isinstance(part.get("sha256"), str)
            and isinstance(part.get("bytes"), int) and not part["key"].startswith("/")
            and ".." not in part["key"].split("/")):
        raise FeatureDataError(f"{where}/{MANIFEST_NAME}: a part is {part!r}, expected key, bytes and sha256: "
                               "rerun the features job")
    data = _read_bytes(filesystem, f"{directory}/{part['key']}", where)
    if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
        raise FeatureDataError(f"{where}/{part['key']}: {len(data)} bytes that are not those the manifest names "
                               f"({part['bytes']} bytes, sha256 {part['sha256'][:12]}): rerun the features job")
    return pq.read_table(pa.BufferReader(data))


def _read_partition(
    filesystem: pafs.FileSystem, directory: str, where: str, feature_columns: tuple[str, ...],
    parts: list | None = None,
) -> pa.Table:
    if parts is not None and not isinstance(parts, list):
        raise FeatureDataError(f"{where}/{MANIFEST_NAME}: parts is {parts!r}, expected a list: rerun the features job")
    named = ([(part["key"], _read_part(filesystem, directory, where, part)) for part in parts] if parts is not None
             else [(path.rsplit("/", 1)[-1], pq.read_table(path, filesystem=filesystem))
                   for path in _listed_files(filesystem, directory)])
    wanted = [ID_COLUMN, LABEL_COLUMN, *feature_columns]
    tables = []
    for name, table in named:
        missing = [column for column in wanted if column not in table.schema.names]
        if missing:
            raise FeatureDataError(f"{where}/{name} lacks columns {missing}")
        table = table.select(wanted)
        _check_types(table, f"{where}/{name}", feature_columns)
        tables.append(table)
    if not tables:
        return pa.table(
            {ID_COLUMN: pa.array([], pa.string()), LABEL_COLUMN: pa.array([], pa.int32())}
            | {name: pa.array([], pa.float32()) for name in feature_columns}
        )
    return pa.concat_tables(tables, promote_options="permissive")


def _check_types(table: pa.Table, where: str, feature_columns: tuple[str, ...]) -> None:
    id_type = table.schema.field(ID_COLUMN).type
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type)):
        raise FeatureDataError(f"{where}: {ID_COLUMN} must be a string column, got {id_type}")
    label_type = table.schema.field(LABEL_COLUMN).type
    if not (pa.types.is_integer(label_type) or pa.types.is_boolean(label_type)):
        raise FeatureDataError(f"{where}: {LABEL_COLUMN} must be an integer 0/1 column, got {label_type}")
    for name in feature_columns:
        column_type = table.schema.field(name).type
        if not (pa.types.is_integer(column_type) or pa.types.is_floating(column_type)):
            raise FeatureDataError(f"{where}: feature column {name} must be numeric, got {column_type}")
    for name in (ID_COLUMN, LABEL_COLUMN, *feature_columns):
        nulls = table.column(name).null_count
        if nulls:
            raise FeatureDataError(f"{where}: column {name} has {nulls} null values")
    labels = table.column(LABEL_COLUMN).cast(pa.int64())
    if table.num_rows and not pc.all(pc.is_in(labels, value_set=pa.array([0, 1], pa.int64()))).as_py():
        raise FeatureDataError(f"{where}: {LABEL_COLUMN} holds values other than 0 and 1")
