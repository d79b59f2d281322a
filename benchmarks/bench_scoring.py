"""Batch scoring throughput: the Spark scoring stage vs one plain process vs a row-at-a-time Python UDF.

Input: a synthetic features partition of N rows (default 2M; BENCH_SCORING_ROWS overrides) in the features
contract (customer_id, label, the 30 float32 feature columns, _MANIFEST.json with feature_columns), written
as 8 Parquet files with pyarrow: building 2M customers through the features job would take ~40M raw rows.
Model: a TorchScript MLP 30-64-32-1 with a sigmoid.

- spark: ``scoring.run`` (the job's own code: read, mapInPandas over Arrow batches of 65,536 rows, write,
  manifest, publish) in a local[2] session that is already up and has run the same job once (JIT compiled,
  Python workers started, model loaded). That first run is reported beside it (spark_first_job_rows_per_s).
- plain: one Python process, the practical limit on these cores: pyarrow reads the same Parquet, torch (all
  cores) scores batches of 65,536 rows, pyarrow writes the same predictions; read to written file is timed.
- row_udf: a classic (pickled, row-at-a-time) Python UDF calling the model on one row at a time, measured on
  a 1% sample spread over all input files (about 20k rows at 2M) and reported as rows/s.
- whole job: ``spark-submit jobs/score_batch.py`` on the same partition, wall time including JVM start-up.
Targets: spark >= 0.7x plain; spark >= 10x row_udf.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import spark_env

DS = "2026-01-05"
BATCH = 65_536
FILES = 8
SAMPLE_PERCENT = 1


def rows_wanted() -> int:
    return int(os.environ.get("BENCH_SCORING_ROWS", "2000000"))


def synthetic_features(root: Path, rows: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from hybridjobs import storage
    from hybridjobs.features import FEATURE_COLUMNS

    target = storage.partition_dir(root, "features", DS)
    staging = storage.new_staging_dir(target)
    staging.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = -(-rows // FILES)
    for i in range(FILES):
        first, last = i * per_file, min(rows, (i + 1) * per_file)
        n = last - first
        ids = pc.binary_join_element_wise("C", pc.cast(pa.array(np.arange(first, last)), pa.string()), "")
        columns = {"customer_id": ids, "label": pa.array(rng.integers(0, 2, n, dtype=np.int32))}
        columns |= {c: pa.array(rng.normal(size=n).astype(np.float32)) for c in FEATURE_COLUMNS}
        # No dictionary pages: random floats would make the writer fall back mid-column, which Spark's
        # reader decodes ~2x slower than the plain pages a Spark-written features partition has.
        pq.write_table(pa.table(columns), staging / f"part-{i:05d}.parquet", use_dictionary=False)
    manifest = storage.base_manifest("features", DS, rows, [], {"name": "bench_scoring synthetic"})
    manifest["feature_columns"] = list(FEATURE_COLUMNS)
    storage.publish(staging, target, manifest)
    return list(FEATURE_COLUMNS)


def plain_process(root: Path, model_path: Path, feature_columns: list[str], out: Path) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = torch.jit.load(str(model_path)).eval()
    started = time.monotonic()
    table = pq.read_table(root / "features" / f"ds={DS}", columns=["customer_id", *feature_columns])
    read_s = time.monotonic() - started
    scores = np.empty(table.num_rows, dtype=np.float32)
    with torch.inference_mode():
        for offset in range(0, table.num_rows, BATCH):
            batch = table.slice(offset, BATCH)
            inputs = np.column_stack([batch.column(c).to_numpy() for c in feature_columns])
            scores[offset:offset + batch.num_rows] = model(torch.from_numpy(inputs)).numpy().reshape(-1)
    scored_s = time.monotonic() - started
    versions = pa.array(["bench"]).take(np.zeros(table.num_rows, dtype=np.int32))
    predictions = pa.table({"customer_id": table.column("customer_id"), "score": scores,
                            "model_version": versions})
    pq.write_table(predictions, out)
    seconds = time.monotonic() - started
    return {"rows": table.num_rows, "seconds": seconds, "read_s": read_s, "score_s": scored_s - read_s,
            "rows_per_s": table.num_rows / seconds}


def score_one_row(model_path: str, *values: float) -> float:
    """The row-at-a-time baseline: one model call per row (the model is cached per worker, as in the job)."""
    import torch
    from hybridjobs import scoring

    torch.set_num_threads(1)
    model = scoring.load_model(model_path)
    with torch.inference_mode():
        return float(model(torch.tensor([values], dtype=torch.float32))[0, 0])


def row_udf(spark, root: Path, model_path: Path, feature_columns: list[str], out: Path) -> dict:
    from functools import partial

    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    spark.sparkContext.addPyFile(spark_env.__file__)
    spark.sparkContext.addPyFile(__file__)
    score = F.udf(partial(score_one_row, str(model_path)), FloatType(), useArrow=False)
    sample = (spark.read.parquet(str(root / "features" / f"ds={DS}"))
              .where(F.abs(F.hash("customer_id")) % 100 < SAMPLE_PERCENT))
    started = time.monotonic()
    sample.select("customer_id", score(*feature_columns).alias("score")).write.parquet(str(out))
    seconds = time.monotonic() - started
    rows = spark.read.parquet(str(out)).count()
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def whole_job(root: Path, model_path: Path) -> dict:
    command = [str(Path(sys.executable).parent / "spark-submit"), "--master", spark_env.MASTER,
               "--driver-memory", "2g", "--conf", "spark.ui.enabled=false", "--conf", "spark.log.level=WARN",
               str(spark_env.JOBS / "score_batch.py"), "--root", str(root), "--ds", DS,
               "--model", str(model_path), "--model-version", "bench-submit", "--batch-size", str(BATCH)]
    env = {**os.environ, **spark_env.python_env()}
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"spark-submit score_batch.py exited {done.returncode}:\n{done.stderr[-4000:]}")
    printed = re.search(r"^SCORING .*rows_per_s=([0-9.]+)", done.stdout, re.M)
    return {"wall_s": wall, "job_rows_per_s": float(printed.group(1)) if printed else None}


def main() -> dict:
    from hybridjobs import scoring

    rows = rows_wanted()
    root = Path(tempfile.mkdtemp(prefix="bench-scoring-"))
    try:
        feature_columns = synthetic_features(root, rows)
        model_path = root / "model.pt"
        spark_env.mlp(len(feature_columns), model_path)
        context = spark_env.machine()

        plain = plain_process(root, model_path, feature_columns, root / "plain-predictions.parquet")
        print(f"plain process: {plain['rows_per_s']:.0f} rows/s ({plain['seconds']:.2f} s)", flush=True)

        spark = spark_env.session("bench-scoring")
        try:
            started = time.monotonic()
            scoring.run(spark, str(root), DS, str(model_path), "bench", BATCH)
            first_s = time.monotonic() - started
            started = time.monotonic()
            manifest = scoring.run(spark, str(root), DS, str(model_path), "bench", BATCH)
            spark_s = time.monotonic() - started
            print(f"spark: {rows / spark_s:.0f} rows/s ({rows / first_s:.0f} as the session's first job)",
                  flush=True)
            udf = row_udf(spark, root, model_path, feature_columns, root / "row-udf")
            print(f"row-at-a-time UDF: {udf['rows_per_s']:.0f} rows/s on {udf['rows']} rows", flush=True)
        finally:
            spark.stop()
        job = whole_job(root, model_path)
        print(f"spark-submit whole job: {job['wall_s']:.1f} s wall", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    spark_rps = rows / spark_s
    result = {
        "rows": rows,
        "spark_rows_per_s": round(spark_rps),
        "plain_rows_per_s": round(plain["rows_per_s"]),
        "row_udf_rows_per_s": round(udf["rows_per_s"]),
        "spark_seconds": round(spark_s, 3),
        "spark_first_job_rows_per_s": round(rows / first_s),
        "spark_first_job_seconds": round(first_s, 3),
        "spark_job_reported_rows_per_s": manifest["job"]["rows_per_s"],
        "plain_seconds": round(plain["seconds"], 3),
        "plain_read_s": round(plain["read_s"], 3),
        "plain_score_s": round(plain["score_s"], 3),
        "row_udf_sample_rows": udf["rows"],
        "row_udf_seconds": round(udf["seconds"], 3),
        "spark_vs_plain": round(spark_rps / plain["rows_per_s"], 3),
        "spark_vs_row_udf": round(spark_rps / udf["rows_per_s"], 1),
        "target_spark_vs_plain_min": 0.7,
        "target_spark_vs_row_udf_min": 10,
        "targets_met": spark_rps >= 0.7 * plain["rows_per_s"] and spark_rps >= 10 * udf["rows_per_s"],
        "whole_job_wall_s": round(job["wall_s"], 1),
        "whole_job_rows_per_s_incl_startup": round(rows / job["wall_s"]),
        "whole_job_reported_rows_per_s": job["job_rows_per_s"],
        "batch_size": BATCH,
        "loadavg_1m_after": os.getloadavg()[0],
        **context,
    }
    print(f"RESULT scoring rows={rows} spark_rows_per_s={result['spark_rows_per_s']} "
          f"plain_rows_per_s={result['plain_rows_per_s']} row_udf_rows_per_s={result['row_udf_rows_per_s']}",
          flush=True)
    return result
