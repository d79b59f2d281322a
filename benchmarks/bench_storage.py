"""Storage cost: the same Spark DataFrame written and read back through ``hybridjobs.sparkio`` on a POSIX root and
on the stack's S3 endpoint, beside Spark's own Parquet writer and reader on POSIX (what the stages use today).

BENCH_STORAGE_ROWS (default 1,000,000) rows of a features-like table (a customer id and 32 float32 columns, about
140 MB in memory) in 2 tasks, cached before any timing; a round writes the partition (a rerun: it replaces the
last one) and reads every part back (a sum over each column). Each target gets one untimed round, then
BENCH_STORAGE_REPEATS (default 5) timed ones; the figure is their median, with the min and max beside it. The
issue's goal: the object store at >= 0.8x POSIX (``s3_vs_posix`` = POSIX seconds / S3 seconds, both sparkio).
``s3_raw_transfer`` puts and gets the same bytes with no Spark and no Parquet: the endpoint's own ceiling here, and
``sparkio_s3_vs_raw_transfer`` how close the layer comes to it.

The S3 endpoint here is moto's server (one Python process on the same 2 cores as Spark), much slower per byte
than a real store: the ratio measured here is a floor for the layer, not a forecast for an estate.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import spark_env
from bench_triton import stack_environment

COLUMNS = 32
GOAL = 0.8


def timed(round_trip: Callable[[], None], repeats: int) -> dict[str, float]:
    round_trip()  # warm-up: the JIT, the connection pool, the first bucket listing
    seconds = []
    for _ in range(repeats):
        started = time.monotonic()
        round_trip()
        seconds.append(time.monotonic() - started)
    return {"median_s": round(statistics.median(seconds), 3), "min_s": round(min(seconds), 3),
            "max_s": round(max(seconds), 3), "repeats": repeats}


def s3_target(bucket: str):
    """The stack's S3 endpoint and keys (the ``storage_s3`` connection `make up` wrote), a bucket of its own."""
    import boto3
    from hybridjobs.objectstore import S3Access

    stack_environment()
    connection = json.loads(os.environ["AIRFLOW_CONN_STORAGE_S3"])
    access = S3Access(endpoint_url=connection["extra"]["endpoint_url"], region=connection["extra"]["region_name"],
                      access_key=connection["login"], secret_key=connection["password"])
    client = boto3.client("s3", endpoint_url=access.endpoint_url, region_name=access.region,
                          aws_access_key_id=access.access_key, aws_secret_access_key=access.secret_key)
    client.create_bucket(Bucket=bucket)
    return access, client


def empty_bucket(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])
    client.delete_bucket(Bucket=bucket)


def raw_transfer(access, bucket: str, total_bytes: int, streams: int = 2) -> Callable[[], None]:
    """The store's own ceiling on this machine: the same bytes put and got whole by ``streams`` writers at once
    (as the 2 tasks do), with no Spark, no Parquet and no hashing."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridjobs.objectstore import open_uri

    payload = os.urandom(total_bytes // streams)

    def one(index: int) -> None:
        location = open_uri(f"s3://{bucket}/raw-transfer/object-{index}", access)
        location.write_bytes(payload)
        assert len(location.read_bytes()) == len(payload)

    def round_trip() -> None:
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, range(streams)))
    return round_trip


def main() -> dict:
    from hybridjobs import objectstore, sparkio
    from pyspark.sql import functions as F

    rows = int(os.environ.get("BENCH_STORAGE_ROWS", "1000000"))
    repeats = int(os.environ.get("BENCH_STORAGE_REPEATS", "5"))
    bucket = f"bench-storage-{uuid.uuid4().hex[:8]}"
    access, client = s3_target(bucket)
    root = tempfile.mkdtemp(prefix="bench-storage-")
    context = spark_env.machine()
    spark = spark_env.session("bench-storage")
    try:
        table = spark.range(rows, numPartitions=2).select(
            F.format_string("c%09d", "id").alias("customer_id"),
            *(F.rand(seed).cast("float").alias(f"f{seed:02d}") for seed in range(COLUMNS))).cache()
        table.count()
        sums = [F.sum(c) for c in table.columns[1:]]

        def native() -> None:
            path = f"{root}/native"
            table.write.mode("overwrite").parquet(path)
            spark.read.parquet(path).agg(*sums).collect()

        def through_sparkio(uri: str, target_access) -> Callable[[], None]:
            def round_trip() -> None:
                sparkio.write_partition(table, uri, access=target_access)
                sparkio.read_partition(spark, uri, access=target_access).agg(*sums).collect()
            return round_trip

        figures = {
            "spark_parquet_posix": timed(native, repeats),
            "sparkio_posix": timed(through_sparkio(f"{root}/sparkio", None), repeats),
            "sparkio_s3": timed(through_sparkio(f"s3://{bucket}/features/ds=2026-07-17", access), repeats),
        }
        manifest_bytes = sum(part["bytes"] for part in objectstore.read_manifest(
            objectstore.open_uri(f"s3://{bucket}/features/ds=2026-07-17", access))["parts"])
        figures["s3_raw_transfer"] = timed(raw_transfer(access, bucket, manifest_bytes), repeats)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
        empty_bucket(client, bucket)

    posix, s3 = figures["sparkio_posix"]["median_s"], figures["sparkio_s3"]["median_s"]
    ratio = round(posix / s3, 3)
    result = {
        "rows": rows, "columns": COLUMNS + 1, "parquet_mb": round(manifest_bytes / 1e6, 1), **figures,
        "s3_vs_posix": ratio, "sparkio_vs_spark_parquet": round(figures["spark_parquet_posix"]["median_s"] / posix, 3),
        "s3_mb_per_s": round(2 * manifest_bytes / 1e6 / s3, 1),
        "s3_raw_mb_per_s": round(2 * manifest_bytes / 1e6 / figures["s3_raw_transfer"]["median_s"], 1),
        "sparkio_s3_vs_raw_transfer": round(figures["s3_raw_transfer"]["median_s"] / s3, 3),
        "goal_s3_vs_posix_min": GOAL,
        "goal_met": ratio >= GOAL, "context": context,
    }
    print(f"RESULT storage rows={rows} posix_s={posix} s3_s={s3} s3_vs_posix={ratio} "
          f"spark_parquet_s={figures['spark_parquet_posix']['median_s']} "
          f"sparkio_vs_spark_parquet={result['sparkio_vs_spark_parquet']} s3_raw_mb_per_s={result['s3_raw_mb_per_s']} "
          f"sparkio_s3_vs_raw_transfer={result['sparkio_s3_vs_raw_transfer']} goal_met={result['goal_met']}",
          flush=True)
    return result


if __name__ == "__main__":
    main()
