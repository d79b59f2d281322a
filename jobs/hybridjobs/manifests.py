"""What the manifests say about written Parquet, computed on the driver with pyarrow (no Spark job needed).

The outputs these functions read are small (one row per customer, the quarantined rows, the scores) or only
their footers are read (row counts), so a Spark job for them would cost more in scheduling and code generation
than the work itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridjobs import storage

# Why the features job quarantines a raw row, in priority order (a row gets the first reason that applies); the
# raw generator plants exactly these defects, and the manifests count rows per reason.
QUARANTINE_REASONS = (
    "invalid_utf8",
    "missing_customer_id",
    "bad_timestamp",
    "future_timestamp",
    "unknown_event_type",
    "bad_amount_type",
    "negative_amount",
)


def partition_files(partition: str | Path, subdir: str = "") -> list[Path]:
    base = Path(partition) / subdir if subdir else Path(partition)
    return [base / name for name in storage.data_files(base) if name.endswith(".parquet")]


def read_files(files: Sequence[Path], columns: Sequence[str] | None = None) -> pa.Table:
    tables = [pq.read_table(f, columns=list(columns) if columns else None) for f in files]
    return pa.concat_tables(tables) if tables else pa.table({})


def parquet_rows(files: Iterable[Path]) -> int:
    """Row count from the footers only."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 6)


def column_stats(files: Sequence[Path], columns: Sequence[str], numeric: Sequence[str]) -> dict[str, Any]:
    """Null ratio of ``columns``; NaN ratio and min/mean/max of ``numeric`` (NaN excluded from min/mean/max).
    Reads one column at a time, so driver memory stays at one column of the output."""
    return table_stats(lambda names: read_files(files, names), parquet_rows(files), columns, numeric)


def table_stats(read: Callable[[list[str]], pa.Table], rows: int, columns: Sequence[str],
                numeric: Sequence[str]) -> dict[str, Any]:
    """:func:`column_stats` of the ``rows`` that ``read(column names)`` returns, one column at a time."""

    def ratio(n: int) -> float:
        return round(n / rows, 6) if rows else 0.0

    null_ratio, nan_ratio, stats = {}, {}, {}
    for name in columns:
        column = read([name]).column(name) if rows else pa.chunked_array([], pa.float32())
        null_ratio[name] = ratio(column.null_count)
        if name not in numeric:
            continue
        is_nan = pc.fill_null(pc.is_nan(column), False)
        nan_ratio[name] = ratio(pc.sum(is_nan).as_py() or 0)
        clean = pc.filter(column, pc.invert(is_nan))
        bounds = pc.min_max(clean)
        stats[name] = {"min": _round(bounds["min"].as_py()), "mean": _round(pc.mean(clean).as_py()),
                       "max": _round(bounds["max"].as_py())}
    return {"row_count": rows, "null_ratio": null_ratio, "nan_ratio": nan_ratio, "feature_stats": stats}


def count_by(table: pa.Table, column: str, keys: Sequence[str]) -> dict[str, int]:
    """Rows per value of ``column`` for every key (0 when absent); values outside ``keys`` are an error."""
    counted = {}
    if table.num_rows:
        for entry in pc.value_counts(table.column(column)).to_pylist():
            counted[entry["values"]] = entry["counts"]
    unknown = sorted(set(counted) - set(keys), key=str)
    if unknown:
        raise ValueError(f"{column} has values {unknown} outside {list(keys)}")
    return {key: int(counted.get(key, 0)) for key in keys}
