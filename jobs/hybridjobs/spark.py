"""Session helpers shared by the Spark jobs."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

PACKAGE_DIR = Path(__file__).resolve().parent

# Spark's simple type names -> the manifest's type names (numpy/pyarrow style, explicit widths).
MANIFEST_TYPES = {
    "string": "string",
    "binary": "binary",
    "boolean": "bool",
    "tinyint": "int8",
    "smallint": "int16",
    "int": "int32",
    "bigint": "int64",
    "float": "float32",
    "double": "float64",
    "date": "date",
    "timestamp": "timestamp",
}

BASE_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # The jobs write their own _SUCCESS after the manifest; Spark's own marker would come too early.
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
}


def build_session(app_name: str, extra_conf: dict[str, str] | None = None) -> SparkSession:
    """The job's session; the master and everything else come from spark-submit."""
    builder = SparkSession.builder.appName(app_name)
    for key, value in {**BASE_CONF, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    ship_package(spark)
    return spark


def package_zip() -> Path:
    """A zip of this package, named by its content so executors never run a stale copy."""
    files = sorted(p for p in PACKAGE_DIR.rglob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode())
        digest.update(path.read_bytes())
    target = Path(tempfile.gettempdir()) / f"hybridjobs-{digest.hexdigest()[:16]}.zip"
    if not target.exists():
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in files:
                archive.write(path, f"hybridjobs/{path.relative_to(PACKAGE_DIR)}")
        partial.replace(target)
    return target


def ship_package(spark: SparkSession) -> None:
    """Makes ``hybridjobs`` importable in the executors' Python workers (local and cluster masters)."""
    spark.sparkContext.addPyFile(str(package_zip()))


def manifest_columns(df: DataFrame) -> list[dict[str, str]]:
    return [{"name": f.name, "type": MANIFEST_TYPES.get(f.dataType.simpleString(), f.dataType.simpleString())}
            for f in df.schema.fields]


def job_section(spark: SparkSession, name: str, started: float, rows: int, rate_key: str = "rows_per_s",
                **details: Any) -> dict[str, Any]:
    """A Spark stage's ``job`` manifest section: the application, its seconds since ``started`` (monotonic) and
    its rate of ``rows`` per second under ``rate_key``, then the stage's own ``details``."""
    seconds = round(time.monotonic() - started, 3)
    return {"name": name, "spark_master": spark.sparkContext.master, "spark_app_id": spark.sparkContext.applicationId,
            "seconds": seconds, rate_key: round(rows / seconds, 1) if seconds else None, **details}
