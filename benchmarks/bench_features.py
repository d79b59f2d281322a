"""Feature engineering cost: seconds per million raw rows at 1M and 5M rows (Spark session start-up excluded).

For each size the raw partition is generated first (not timed) into a tmp storage root, then the features
job's own ``features.run`` (read raw, quarantine, aggregate per customer, join labels, write, manifest,
publish) is timed in a session that is already up, with a look-back of one day so exactly N raw rows are read.
One untimed run over the 1M partition first warms the JVM's JIT compiler, which would otherwise be charged to
the first figure (``s_per_mrow_1m_cold_jit`` in the JSON). Target: cost per row at 5M at most 20% above 1M.
Sizes can be overridden for a quick try: BENCH_FEATURES_ROWS=100000,500000.

Then the same work on an object store: the small partition generated onto the stack's S3 endpoint (a bucket of its
own), ``features.run`` timed on the ``s3://`` root (hybridjobs/datasets.py: no Hadoop S3 connector), and
``s3_vs_posix_small`` = POSIX seconds / S3 seconds (issue 38's goal: >= 0.8). Moto's server is that endpoint here,
one Python process on the same 2 cores: a floor for the layer, not a forecast for an estate.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import spark_env
from bench_storage import empty_bucket, s3_target

DS_SMALL, DS_LARGE = "2026-01-03", "2026-01-05"


def sizes() -> tuple[int, int]:
    small, large = os.environ.get("BENCH_FEATURES_ROWS", "1000000,5000000").split(",")
    return int(small), int(large)


def generate(root: Path, ds: str, rows: int) -> float:
    from hybridjobs import storage
    from hybridjobs.generator import GeneratorConfig, generate_partition

    started = time.monotonic()
    target = storage.partition_dir(root, "raw", ds)
    staging = storage.new_staging_dir(target)
    details = generate_partition(staging, ds, GeneratorConfig(rows=rows))
    storage.publish(staging, target, {"dataset": "raw", "ds": ds, "row_count": rows, **details})
    return time.monotonic() - started


def generate_on_object_store(root: str, ds: str, rows: int) -> float:
    """The job itself (jobs/generate_raw.py) onto ``root``, with the keys in its environment as an operator hands
    them."""
    started = time.monotonic()
    subprocess.run([sys.executable, str(spark_env.JOBS / "generate_raw.py"), "--root", root, "--ds", ds,
                    "--rows", str(rows)], check=True, capture_output=True, timeout=1800)
    return time.monotonic() - started


def use_keys(access) -> None:
    """The standard AWS environment, which the jobs read (hybridjobs/objectstore.py)."""
    os.environ.update(AWS_ACCESS_KEY_ID=access.access_key, AWS_SECRET_ACCESS_KEY=access.secret_key,
                      AWS_ENDPOINT_URL=access.endpoint_url, AWS_REGION=access.region)


def main() -> dict:
    from hybridjobs import features

    small, large = sizes()
    root = Path(tempfile.mkdtemp(prefix="bench-features-"))
    bucket = f"bench-features-{uuid.uuid4().hex[:8]}"
    access, client = s3_target(bucket)
    use_keys(access)
    s3_root = f"s3://{bucket}/storage"
    try:
        generated = {rows: generate(root, ds, rows) for ds, rows in ((DS_SMALL, small), (DS_LARGE, large))}
        generated_s3_s = generate_on_object_store(s3_root, DS_SMALL, small)
        context = spark_env.machine()
        spark = spark_env.session("bench-features")
        try:
            started = time.monotonic()
            features.run(spark, str(root), DS_SMALL, lookback_days=1)
            cold_s = time.monotonic() - started
            timings = {}
            for ds, rows in ((DS_SMALL, small), (DS_LARGE, large)):
                started = time.monotonic()
                manifest = features.run(spark, str(root), ds, lookback_days=1)
                timings[rows] = (time.monotonic() - started, manifest)
            started = time.monotonic()
            s3_manifest = features.run(spark, s3_root, DS_SMALL, lookback_days=1)
            s3_s = time.monotonic() - started
        finally:
            spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        empty_bucket(client, bucket)
    if s3_manifest["row_count"] != timings[small][1]["row_count"]:
        raise AssertionError(f"the object store's features have {s3_manifest['row_count']} rows, POSIX's "
                             f"{timings[small][1]['row_count']}")

    s_small = timings[small][0] / (small / 1e6)
    s_large = timings[large][0] / (large / 1e6)
    result = {
        "s_per_mrow_1m": round(s_small, 3),
        "s_per_mrow_5m": round(s_large, 3),
        "rows_small": small,
        "rows_large": large,
        "seconds_small": round(timings[small][0], 3),
        "seconds_large": round(timings[large][0], 3),
        "cost_growth": round(s_large / s_small, 3),
        "s_per_mrow_1m_cold_jit": round(cold_s / (small / 1e6), 3),
        "target_cost_growth_max": 1.2,
        "target_met": s_large <= 1.2 * s_small,
        "customers_small": timings[small][1]["row_count"],
        "customers_large": timings[large][1]["row_count"],
        "quarantined_large": timings[large][1]["quarantine"]["rows"],
        "generator_seconds": {str(k): round(v, 3) for k, v in generated.items()},
        "s3_seconds_small": round(s3_s, 3),
        "s3_vs_posix_small": round(timings[small][0] / s3_s, 3),
        "s3_goal_min": 0.8,
        "s3_generator_seconds_small": round(generated_s3_s, 3),
        "loadavg_1m_after": os.getloadavg()[0],
        **context,
    }
    print(f"RESULT features s_per_mrow_1m={result['s_per_mrow_1m']} s_per_mrow_5m={result['s_per_mrow_5m']} "
          f"s3_vs_posix_small={result['s3_vs_posix_small']}", flush=True)
    return result
