"""A tiny Spark job that proves the master schedules tasks and executors run Python workers.

Usage: spark-submit jobs/spark_healthcheck.py [N]
Prints `HEALTHCHECK sum=<s> expected=<e>` and exits 1 when they differ. Never imports Airflow.
"""

import sys

from pyspark.sql import SparkSession


def main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else 100_000
    spark = SparkSession.builder.appName("hybridflow-healthcheck").getOrCreate()
    try:
        total = spark.sparkContext.parallelize(range(n), 4).map(lambda x: 2 * x).sum()
        master = spark.sparkContext.master
    finally:
        spark.stop()
    expected = n * (n - 1)
    print(f"HEALTHCHECK master={master} sum={total} expected={expected}", flush=True)
    return 0 if total == expected else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
