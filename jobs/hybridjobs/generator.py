"""Deterministic raw customer events for one daily partition, with a planted propensity signal and defects.

Vectorised numpy + pyarrow (no Spark, no Python loop over rows). The same (ds, config) always gives the same
bytes. The customer population (ids, latent traits, country) depends only on ``population_seed`` and
``customers``, so partitions of different days describe the same customers and a look-back window makes sense.

Planted signal: each customer has a latent engagement ``e`` and spend level ``m``. Engagement raises the share
of add-to-cart and purchase events and of the app channel; spend raises amounts; activity (how many events a
customer makes, Zipf-Mandelbrot over customers) is skewed. The label of a ds ("converts in the following
period") is Bernoulli(sigmoid(-1.8 + 1.2 e + 0.7 m + 0.4 activity_z)), so it is learnable from behaviour.

Raw format: Parquet under ``raw/ds=<ds>/events/`` with every column ``binary`` (the bytes as received), so
rows that are not valid UTF-8, not numbers or not timestamps are representable; labels under
``raw/ds=<ds>/labels/`` (``customer_id`` string, ``label`` int32) for the whole population.

Defects: a configurable share of rows gets exactly one defect each; the kinds and their names match the
quarantine reasons of the features job, and the manifest records how many of each were planted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridjobs.manifests import QUARANTINE_REASONS
from hybridjobs.storage import parse_ds

RAW_COLUMNS = ("event_id", "customer_id", "event_ts", "event_type", "amount", "channel", "device", "country")
TEXT_FIELDS_FOR_GARBAGE = ("customer_id", "event_type", "channel", "device", "country")
EVENT_TYPES = ("view", "click", "add_to_cart", "purchase", "support_contact")
CHANNELS = ("web", "app", "store", "email")
DEVICES = ("mobile", "desktop", "tablet")
COUNTRIES = ("US", "GB", "DE", "FR", "IN", "BR", "CA", "ES", "IT", "NL", "JP", "MX", "PL", "SE", "AU")
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
ROW_GROUP_ROWS = 100_000

# The defects planted are the features job's quarantine reasons, one kind each.
DEFECT_KINDS = QUARANTINE_REASONS

_GARBAGE_BYTES = [b"\xff\xfe\xfd", b"caf\xe9", b"\xc3\x28", b"\x80abc", b"\xed\xa0\x80", b"id-\xff\xff"]
_BAD_TIMESTAMPS = [b"not-a-time", b"2026-13-45T99:99:99Z", b"", b"31/12/2025 10:00", None, b"1735689600"]
_BAD_AMOUNTS = [b"12,50", b"abc", b"$19.99", b"NaN", b"1.2.3", b"Infinity"]
_BAD_EVENT_TYPES = [b"purch@se", b"VIEW!!", b"<script>", b"??", b"null", None]
_MISSING_IDS = [None, None, b"", b"   "]


@dataclass(frozen=True)
class GeneratorConfig:
    """How much to generate. ``customers`` defaults to rows // 20 (at least 200); pass it explicitly when
    several days must describe the same population."""

    rows: int
    customers: int | None = None
    malformed_share: float = 0.02
    defect_weights: Mapping[str, float] = field(default_factory=lambda: {k: 1.0 for k in DEFECT_KINDS})
    population_seed: int = 7
    rows_per_file: int = 500_000

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.customers is not None and self.customers < 1:
            raise ValueError(f"customers must be >= 1, got {self.customers}")
        if not 0.0 <= self.malformed_share <= 1.0:
            raise ValueError(f"malformed_share must be within [0, 1], got {self.malformed_share}")
        unknown = set(self.defect_weights) - set(DEFECT_KINDS)
        if unknown:
            raise ValueError(f"unknown defect kinds {sorted(unknown)}; known: {', '.join(DEFECT_KINDS)}")
        if any(w < 0 for w in self.defect_weights.values()) or not any(self.defect_weights.values()):
            raise ValueError(f"defect weights must be >= 0 and not all zero, got {dict(self.defect_weights)}")
        if self.rows_per_file < 1:
            raise ValueError(f"rows_per_file must be >= 1, got {self.rows_per_file}")

    @property
    def n_customers(self) -> int:
        return self.customers if self.customers is not None else max(200, self.rows // 20)


@dataclass(frozen=True)
class Population:
    ids: pa.Array
    activity: np.ndarray
    engagement: np.ndarray
    spend: np.ndarray
    country: np.ndarray
    device: np.ndarray
    activity_z: np.ndarray


def make_population(n_customers: int, population_seed: int) -> Population:
    rng = np.random.default_rng([population_seed, n_customers])
    numbers = pa.array(np.arange(1, n_customers + 1))
    ids = pc.binary_join_element_wise("C", pc.utf8_lpad(pc.cast(numbers, pa.string()), 8, "0"), "")
    # Zipf-Mandelbrot activity over a random ranking: heavy tail, top customer well under 1% of events.
    ranks = rng.permutation(n_customers) + 1
    weights = 1.0 / np.power(ranks + 50.0, 1.05)
    activity = weights / weights.sum()
    log_w = np.log(weights)
    country_w = 1.0 / np.power(np.arange(1, len(COUNTRIES) + 1), 1.2)
    return Population(
        ids=ids,
        activity=activity,
        engagement=rng.standard_normal(n_customers),
        spend=rng.standard_normal(n_customers),
        country=rng.choice(len(COUNTRIES), size=n_customers, p=country_w / country_w.sum()),
        device=rng.choice(len(DEVICES), size=n_customers, p=[0.55, 0.35, 0.10]),
        activity_z=(log_w - log_w.mean()) / (log_w.std() or 1.0),
    )


def label_logit(pop: Population) -> np.ndarray:
    return -1.8 + 1.2 * pop.engagement + 0.7 * pop.spend + 0.4 * pop.activity_z


def make_labels(pop: Population, ds: str, population_seed: int) -> pa.Table:
    rng = np.random.default_rng([population_seed, parse_ds(ds).toordinal(), 1_000_003])
    p = 1.0 / (1.0 + np.exp(-label_logit(pop)))
    labels = (rng.random(len(p)) < p).astype(np.int32)
    return pa.table({"customer_id": pop.ids, "label": pa.array(labels, pa.int32())})


def _categorical(rng: np.random.Generator, logits: np.ndarray) -> np.ndarray:
    """One draw per row from softmax(logits[row]); vectorised inverse-CDF."""
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(weights, axis=1)
    u = rng.random(len(logits))[:, None] * cdf[:, -1:]
    return (u > cdf).sum(axis=1)


def _take(values: list[bytes | None], idx: np.ndarray) -> pa.Array:
    return pa.array(values, pa.binary()).take(pa.array(idx))


def _draw(rng: np.random.Generator, pool: list[bytes | None], n: int) -> pa.Array:
    """``n`` values drawn from ``pool`` with replacement."""
    return _take(pool, rng.integers(0, len(pool), n))


def _format_ts(seconds: np.ndarray) -> pa.Array:
    ts = pa.array(seconds.astype("datetime64[s]")).cast(pa.timestamp("s", tz="UTC"))
    return pc.cast(pc.strftime(ts, format=TIMESTAMP_FORMAT), pa.binary())


def _format_amount(values: np.ndarray) -> pa.Array:
    return pc.cast(pc.cast(pc.round(pa.array(values), 2), pa.string()), pa.binary())


def _defect_counts(rng: np.random.Generator, rows: int, config: GeneratorConfig) -> dict[str, int]:
    total = int(round(rows * config.malformed_share))
    weights = np.array([config.defect_weights.get(k, 0.0) for k in DEFECT_KINDS], dtype=float)
    drawn = rng.multinomial(total, weights / weights.sum())
    return {kind: int(n) for kind, n in zip(DEFECT_KINDS, drawn, strict=True)}


def make_events_chunk(pop: Population, ds: str, chunk: int, rows: int, first_row: int,
                      config: GeneratorConfig) -> tuple[pa.Table, dict[str, int]]:
    """Rows [first_row, first_row + rows) of the ds with their defects; returns the table and the defect
    counts."""
    day = parse_ds(ds)
    rng = np.random.default_rng([config.population_seed, day.toordinal(), chunk])
    day_start = int(datetime.combine(day, datetime.min.time(), tzinfo=UTC).timestamp())

    cust = rng.choice(len(pop.activity), size=rows, p=pop.activity)
    e, m = pop.engagement[cust], pop.spend[cust]
    type_logits = np.stack(
        [np.full(rows, 1.6), np.full(rows, 0.9), -0.5 + 0.5 * e, -1.4 + 0.9 * e, -2.2 - 0.5 * e], axis=1
    )
    event_type = _categorical(rng, type_logits)
    channel = _categorical(
        rng, np.stack([np.full(rows, 0.8), 0.2 + 0.9 * e, np.full(rows, -0.6), np.full(rows, -1.2)], axis=1)
    )
    device = np.where(rng.random(rows) < 0.8, pop.device[cust], rng.integers(0, len(DEVICES), rows))
    device = np.where(channel == CHANNELS.index("app"), np.where(device == 1, 0, device), device)

    is_purchase = event_type == EVENT_TYPES.index("purchase")
    is_cart = event_type == EVENT_TYPES.index("add_to_cart")
    mu = np.where(is_purchase, 3.2 + 0.45 * m, 3.0 + 0.3 * m)
    amount_values = np.maximum(np.round(rng.lognormal(mu, 0.9), 2), 0.5)
    has_amount = is_purchase | is_cart

    # Diurnal: most activity around mid-afternoon, a uniform floor the rest of the day.
    secs = np.where(rng.random(rows) < 0.7, rng.normal(14 * 3600, 4 * 3600, rows),
                    rng.uniform(0, 86400, rows))
    secs = np.clip(secs, 0, 86399).astype(np.int64)

    numbers = pc.cast(pa.array(np.arange(first_row, first_row + rows)), pa.string())
    columns: dict[str, pa.Array] = {
        "event_id": pc.cast(pc.binary_join_element_wise(f"{ds}-", numbers, ""), pa.binary()),
        "customer_id": pc.cast(pop.ids.take(pa.array(cust)), pa.binary()),
        "event_ts": _format_ts(day_start + secs),
        "event_type": _take(list(map(str.encode, EVENT_TYPES)), event_type),
        "amount": pc.if_else(pa.array(has_amount), _format_amount(amount_values),
                             pa.nulls(rows, pa.binary())),
        "channel": _take(list(map(str.encode, CHANNELS)), channel),
        "device": _take(list(map(str.encode, DEVICES)), device),
        "country": _take(list(map(str.encode, COUNTRIES)), pop.country[cust]),
    }

    counts = _defect_counts(rng, rows, config)
    defect_rows = rng.permutation(rows)[: sum(counts.values())]
    start = 0
    for kind in DEFECT_KINDS:
        idx = np.sort(defect_rows[start : start + counts[kind]])
        start += counts[kind]
        if len(idx):
            _plant(kind, idx, columns, rng, day_start, amount_values)
    return pa.table({name: columns[name] for name in RAW_COLUMNS}), counts


def _replace(column: pa.Array, idx: np.ndarray, values: pa.Array) -> pa.Array:
    mask = np.zeros(len(column), dtype=bool)
    mask[idx] = True
    return pc.replace_with_mask(column, pa.array(mask), values)


def _plant(kind: str, idx: np.ndarray, columns: dict[str, pa.Array], rng: np.random.Generator,
           day_start: int, amount_values: np.ndarray) -> None:
    n = len(idx)
    if kind == "invalid_utf8":
        fields = rng.integers(0, len(TEXT_FIELDS_FOR_GARBAGE), n)
        for f, name in enumerate(TEXT_FIELDS_FOR_GARBAGE):
            sel = idx[fields == f]
            if len(sel):
                garbage = _draw(rng, _GARBAGE_BYTES, len(sel))
                columns[name] = _replace(columns[name], sel, garbage)
    elif kind == "missing_customer_id":
        columns["customer_id"] = _replace(columns["customer_id"], idx, _draw(rng, _MISSING_IDS, n))
    elif kind == "bad_timestamp":
        columns["event_ts"] = _replace(columns["event_ts"], idx, _draw(rng, _BAD_TIMESTAMPS, n))
    elif kind == "future_timestamp":
        ahead = rng.integers(86400 + 3600, 86400 + 400 * 86400, n)
        columns["event_ts"] = _replace(columns["event_ts"], idx, _format_ts(day_start + ahead))
    elif kind == "unknown_event_type":
        columns["event_type"] = _replace(columns["event_type"], idx, _draw(rng, _BAD_EVENT_TYPES, n))
    elif kind == "bad_amount_type":
        columns["amount"] = _replace(columns["amount"], idx, _draw(rng, _BAD_AMOUNTS, n))
    elif kind == "negative_amount":
        negative = pc.binary_join_element_wise(b"-", _format_amount(amount_values[idx]), b"")
        columns["amount"] = _replace(columns["amount"], idx, negative)
    else:
        raise ValueError(f"unknown defect kind {kind!r}")


TableWriter = Callable[[str, int, pa.Table], None]  # (table name, part index, rows): writes one part


def parquet_folder_writer(out_dir: Path) -> TableWriter:
    """Parts as ``<out_dir>/<table>/part-<index>.parquet`` (a POSIX staging folder)."""
    def write(table_name: str, index: int, table: pa.Table) -> None:
        folder = out_dir / table_name
        folder.mkdir(parents=True, exist_ok=True)
        # Row groups of 100k rows let Spark split a file across cores.
        pq.write_table(table, folder / f"part-{index:05d}.parquet", compression="snappy",
                       row_group_size=ROW_GROUP_ROWS)
    return write


def generate_partition(out: Path | TableWriter, ds: str, config: GeneratorConfig) -> dict[str, Any]:
    """Writes the tables ``events`` and ``labels`` (into the folder ``out``, or through the writer ``out``);
    returns the generator's part of the manifest."""
    write = parquet_folder_writer(out) if isinstance(out, Path) else out
    pop = make_population(config.n_customers, config.population_seed)
    planted = dict.fromkeys(DEFECT_KINDS, 0)
    n_files = math.ceil(config.rows / config.rows_per_file)
    for chunk in range(n_files):
        first = chunk * config.rows_per_file
        rows = min(config.rows_per_file, config.rows - first)
        table, counts = make_events_chunk(pop, ds, chunk, rows, first, config)
        write("events", chunk, table)
        for kind, n in counts.items():
            planted[kind] += n
    labels = make_labels(pop, ds, config.population_seed)
    write("labels", 0, labels)
    return {
        "labels": {"row_count": labels.num_rows,
                   "positive_rate": round(float(pc.mean(labels["label"]).as_py()), 6)},
        "planted_defects": planted,
        "planted_defects_total": sum(planted.values()),
        "generator": {
            "population_seed": config.population_seed,
            "customers": config.n_customers,
            "malformed_share": config.malformed_share,
            "defect_weights": {k: float(config.defect_weights.get(k, 0.0)) for k in DEFECT_KINDS},
            "rows_per_file": config.rows_per_file,
            "files": n_files,
        },
    }


def parse_defect_weights(text: str | None) -> dict[str, float]:
    """``"bad_amount_type=2,negative_amount=0"`` -> weights; unnamed kinds keep weight 1."""
    weights = {k: 1.0 for k in DEFECT_KINDS}
    if not text:
        return weights
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in DEFECT_KINDS:
            raise ValueError(f"defect weight {item!r}: write kind=weight with kind one of "
                             f"{', '.join(DEFECT_KINDS)}")
        weights[name] = float(value)
    return weights

