"""Feature engineering: raw events of a ds and its look-back window -> one row per customer, plus quarantine.

Every raw row gets at most one quarantine reason, the first that applies in QUARANTINE_REASONS order. Rows
with a reason never reach the features; those of the run's own ds are written to ``quarantine/ds=<ds>/`` with
their original bytes and the reason (look-back partitions were quarantined by their own runs). Bad input
never fails the job; a missing raw partition for the ds does.

Features are computed as of the end of the ds's data interval (midnight UTC after ds) over windows of 1, 7 and
28 days. Counts and money are log1p-transformed (they are heavily skewed), shares and ratios are in [0, 1],
recencies are in days. All feature columns are float32; ``label`` is int32 (0/1) from the ds's labels.
"""

from __future__ import annotations

import time
from datetime import datetime
from functools import reduce
from typing import Any

import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from hybridjobs import datasets, manifests, partitions, storage
from hybridjobs.manifests import QUARANTINE_REASONS
from hybridjobs.spark import job_section, manifest_columns

RAW_COLUMNS = ("event_id", "customer_id", "event_ts", "event_type", "amount", "channel", "device", "country")
TIMESTAMP_PATTERN = "yyyy-MM-dd'T'HH:mm:ss'Z'"
EVENT_TYPES = ("view", "click", "add_to_cart", "purchase", "support_contact")
CHANNELS = ("web", "app", "store", "email")
DEVICES = ("mobile", "desktop", "tablet")
TOP_COUNTRIES = ("US", "GB", "DE", "FR", "IN", "BR")
COUNTRY_CODES = 8  # codes 0..5 for TOP_COUNTRIES, 6 for any other country; must exceed that
WINDOWS_DAYS = (1, 7, 28)
LONGEST_WINDOW_DAYS = max(WINDOWS_DAYS)
DEFAULT_LOOKBACK_DAYS = LONGEST_WINDOW_DAYS
# Larger amounts are no real order: a few of them would overflow the window sums to inf (and float32 features
# to inf well before that), so they count as bad_amount_type.
MAX_ABS_AMOUNT = 1e12


FEATURE_COLUMNS = (
    *(f"log_events_{w}d" for w in WINDOWS_DAYS),
    *(f"log_purchases_{w}d" for w in WINDOWS_DAYS),
    "log_spend_7d",
    "log_spend_28d",
    "log_avg_purchase_amount_28d",
    "log_max_amount_28d",
    "active_days_28d",
    "recency_days",
    "purchase_recency_days",
    "purchase_per_view_28d",
    "cart_to_purchase_28d",
    "support_share_28d",
    *(f"share_{c}_28d" for c in CHANNELS),
    *(f"share_{d}_28d" for d in DEVICES),
    *(f"country_{c}" for c in TOP_COUNTRIES),
    "country_other",
)
OUTPUT_COLUMNS = ("customer_id", "label", *FEATURE_COLUMNS)


def read_raw_events(spark: SparkSession, root: str, ds: str, window: list[str]) -> tuple[DataFrame, list[str]]:
    """Published raw events of ``ds`` and of the look-back days (``window``) that exist, tagged with their
    partition."""
    if not partitions.is_published(root, "raw", ds):
        raise storage.PartitionNotPublishedError(
            f"raw partition {partitions.partition_uri(root, 'raw', ds)} is not published (no _SUCCESS): generate or "
            f"land raw data for ds={ds} first"
        )
    found = [d for d in window if partitions.is_published(root, "raw", d)]
    frames = [
        datasets.read_table(spark, root, "raw", d, list(RAW_COLUMNS), "events")
        .withColumn("source_ds", F.lit(d))
        .withColumn("partition_end", F.lit(storage.interval_end(d)))
        for d in found
    ]
    return reduce(DataFrame.unionByName, frames), found


def with_quarantine_reason(raw: DataFrame) -> DataFrame:
    """Adds ``reason`` (null for a clean row) and the parsed ``ts`` and ``amount_value`` columns."""
    text = {c: F.col(c).cast("string") for c in RAW_COLUMNS}
    utf8_ok = reduce(Column.__and__, [F.coalesce(F.is_valid_utf8(text[c]), F.lit(True)) for c in RAW_COLUMNS])
    customer_id = F.trim(text["customer_id"])
    ts = F.try_to_timestamp(text["event_ts"], F.lit(TIMESTAMP_PATTERN))
    amount_text = F.trim(text["amount"])
    amount_present = F.coalesce(amount_text != F.lit(""), F.lit(False))
    amount = amount_text.try_cast("double")
    known_type = F.coalesce(text["event_type"].isin(*EVENT_TYPES), F.lit(False))
    reason = (
        F.when(~utf8_ok, "invalid_utf8")
        .when(F.coalesce(customer_id == F.lit(""), F.lit(True)), "missing_customer_id")
        .when(ts.isNull(), "bad_timestamp")
        .when(ts >= F.col("partition_end"), "future_timestamp")
        .when(~known_type, "unknown_event_type")
        .when(amount_present & (amount.isNull() | F.isnan(amount) | (F.abs(amount) > MAX_ABS_AMOUNT)),
              "bad_amount_type")
        .when(amount_present & (amount < 0), "negative_amount")
    )
    return raw.select("*", reason.alias("reason"), ts.alias("ts"), amount.alias("amount_value"))


def quarantined_rows(classified: DataFrame, ds: str) -> DataFrame:
    own_rejects = F.col("reason").isNotNull() & (F.col("source_ds") == ds)
    return classified.where(own_rejects).select(*RAW_COLUMNS, "reason")


def customer_features(classified: DataFrame, as_of: datetime) -> DataFrame:
    """One row per customer with a clean event in the longest window before ``as_of``."""
    as_of_s = int(as_of.timestamp())
    events = classified.where(F.col("reason").isNull()).select(
        F.trim(F.col("customer_id").cast("string")).alias("customer_id"),
        (F.lit(as_of_s) - F.unix_seconds("ts")).alias("age_s"),
        F.col("ts"),
        F.col("event_type").cast("string").alias("event_type"),
        F.col("amount_value").alias("amount"),
        F.col("channel").cast("string").alias("channel"),
        F.col("device").cast("string").alias("device"),
        F.col("country").cast("string").alias("country"),
    ).where(F.col("age_s") <= LONGEST_WINDOW_DAYS * 86400)

    country_code = reduce(lambda acc, item: acc.when(F.col("country") == item[1], item[0]),
                          enumerate(TOP_COUNTRIES[1:], start=1),
                          F.when(F.col("country") == TOP_COUNTRIES[0], 0)).otherwise(len(TOP_COUNTRIES))
    event_type = F.col("event_type")
    is_purchase = event_type == "purchase"
    within = {w: F.col("age_s") <= w * 86400 for w in WINDOWS_DAYS}
    day_bit = F.expr("shiftleft(1L, cast((age_s - 1) div 86400 as int))")
    aggregated = events.groupBy("customer_id").agg(
        *(F.count_if(within[w]).alias(f"events_{w}d") for w in WINDOWS_DAYS),
        *(F.count_if(within[w] & is_purchase).alias(f"purchases_{w}d") for w in WINDOWS_DAYS),
        F.sum(F.when(within[7] & is_purchase, F.col("amount"))).alias("spend_7d"),
        F.sum(F.when(is_purchase, F.col("amount"))).alias("spend_28d"),
        F.max("amount").alias("max_amount_28d"),
        F.count_if(event_type == "view").alias("views_28d"),
        F.count_if(event_type == "add_to_cart").alias("carts_28d"),
        F.count_if(event_type == "support_contact").alias("support_28d"),
        F.bit_or(day_bit).alias("active_day_bits"),
        F.min("age_s").alias("min_age_s"),
        F.min(F.when(is_purchase, F.col("age_s"))).alias("min_purchase_age_s"),
        *(F.count_if(F.col("channel") == c).alias(f"n_channel_{c}") for c in CHANNELS),
        *(F.count_if(F.col("device") == d).alias(f"n_device_{d}") for d in DEVICES),
        # Country of the latest event (ties broken by the code): a max over one long keeps this a hash
        # aggregate; max_by over a string column makes Spark sort every event by customer instead.
        F.max(F.unix_seconds("ts") * COUNTRY_CODES + country_code).alias("last_country_key"),
    )

    events_28d = F.col("events_28d")
    last_country = F.pmod(F.col("last_country_key"), F.lit(COUNTRY_CODES))
    derived = {
        **{f"log_events_{w}d": F.log1p(f"events_{w}d") for w in WINDOWS_DAYS},
        **{f"log_purchases_{w}d": F.log1p(f"purchases_{w}d") for w in WINDOWS_DAYS},
        "log_spend_7d": F.log1p(F.coalesce("spend_7d", F.lit(0.0))),
        "log_spend_28d": F.log1p(F.coalesce("spend_28d", F.lit(0.0))),
        "log_avg_purchase_amount_28d": F.log1p(
            F.coalesce(F.col("spend_28d") / F.nullif("purchases_28d", F.lit(0)), F.lit(0.0))
        ),
        "log_max_amount_28d": F.log1p(F.coalesce("max_amount_28d", F.lit(0.0))),
        "active_days_28d": F.bit_count("active_day_bits"),
        "recency_days": F.col("min_age_s") / 86400.0,
        # Never purchased within the window: one day more than the window can see.
        "purchase_recency_days": F.coalesce(
            F.col("min_purchase_age_s") / 86400.0, F.lit(float(LONGEST_WINDOW_DAYS + 1))
        ),
        "purchase_per_view_28d": F.col("purchases_28d") / (F.col("views_28d") + 1),
        "cart_to_purchase_28d": F.col("purchases_28d") / (F.col("carts_28d") + 1),
        "support_share_28d": F.col("support_28d") / events_28d,
        **{f"share_{c}_28d": F.col(f"n_channel_{c}") / events_28d for c in CHANNELS},
        **{f"share_{d}_28d": F.col(f"n_device_{d}") / events_28d for d in DEVICES},
        **{f"country_{c}": (last_country == i).cast("double") for i, c in enumerate(TOP_COUNTRIES)},
        "country_other": (last_country == len(TOP_COUNTRIES)).cast("double"),
    }
    return aggregated.select("customer_id",
                             *(derived[name].cast("float").alias(name) for name in FEATURE_COLUMNS))


def read_labels(spark: SparkSession, root: str, ds: str) -> DataFrame:
    labels = datasets.read_table(spark, root, "raw", ds, ["customer_id", "label"], "labels")
    return labels.select("customer_id", F.col("label").cast("int").alias("label"))


def run(spark: SparkSession, root: str, ds: str,
        lookback_days: int = DEFAULT_LOOKBACK_DAYS) -> dict[str, Any]:
    """Builds and publishes ``quarantine/ds=<ds>``, then ``features/ds=<ds>``, under ``root`` (a local path or
    ``s3://bucket/prefix``); returns the features manifest."""
    started = time.monotonic()
    day = storage.parse_ds(ds)  # the one check of ds: the window and the features' as-of time derive from it
    window, as_of = storage.lookback_ds(day, lookback_days), storage.interval_end(day)
    raw, found = read_raw_events(spark, root, ds, window)
    classified = with_quarantine_reason(raw)

    quarantine_out = datasets.output(root, "quarantine", ds)
    quarantine = quarantined_rows(classified, ds)
    quarantine_out.write(quarantine)

    features_out = datasets.output(root, "features", ds)
    features = customer_features(classified, as_of).join(
        read_labels(spark, root, ds), on="customer_id", how="inner"
    ).select(*OUTPUT_COLUMNS)
    features_out.write(features)

    rows_by_day = {d: partitions.table_rows(root, "raw", d, "events") for d in found}  # ds is among them
    raw_rows, window_rows = rows_by_day[ds], sum(rows_by_day.values())
    by_reason = manifests.count_by(quarantine_out.read(["reason"]), "reason", QUARANTINE_REASONS)
    quarantined = sum(by_reason.values())
    stats = manifests.table_stats(features_out.read, features_out.rows(), OUTPUT_COLUMNS, FEATURE_COLUMNS)
    labels = features_out.read(["label"]).column("label") if stats["row_count"] else None
    label_rate = round(pc.mean(labels).as_py(), 6) if labels is not None else None
    job = job_section(spark, "build_features", started, raw_rows, "raw_rows_per_s", lookback_days=lookback_days,
                      as_of=as_of.isoformat())
    quarantine_section = {
        "rows": quarantined,
        "ratio": round(quarantined / raw_rows, 6) if raw_rows else 0.0,
        "by_reason": by_reason,
        "path": f"quarantine/ds={ds}",
    }
    input_section = {
        "raw_rows": raw_rows,
        "valid_rows": raw_rows - quarantined,
        "lookback_partitions": found,
        "missing_lookback_partitions": [d for d in window if d not in found],
        "window_raw_rows": window_rows,
    }

    quarantine_manifest = storage.base_manifest(
        "quarantine", ds, quarantined, manifest_columns(quarantine), job
    )
    quarantine_manifest.update(by_reason=by_reason, raw_rows=raw_rows, ratio=quarantine_section["ratio"],
                               files=quarantine_out.files())
    quarantine_out.publish(quarantine_manifest)

    manifest = storage.base_manifest("features", ds, stats["row_count"], manifest_columns(features), job)
    manifest.update(
        feature_columns=list(FEATURE_COLUMNS),
        null_ratio=stats["null_ratio"],
        nan_ratio=stats["nan_ratio"],
        label_rate=label_rate,
        feature_stats=stats["feature_stats"],
        quarantine=quarantine_section,
        input=input_section,
        files=features_out.files(),
    )
    return features_out.publish(manifest)
