"""Batch scoring of one features partition with a TorchScript model.

Usage:
  spark-submit jobs/score_batch.py --root /var/lib/hybridflow/storage --ds 2026-01-05 \
      --model /var/lib/hybridflow/storage/models/propensity/7/model.pt --model-version 7 [--batch-size 65536]

Reads the published <root>/features/ds=<ds>/ (its _MANIFEST.json gives the feature column order and the parts),
publishes <root>/predictions/ds=<ds>/ (customer_id, score float32, model_version) with _MANIFEST.json and _SUCCESS,
replacing an earlier run of the same ds. --root is a local path or s3://bucket/prefix. Prints one
`SCORING ... rows_per_s=...` line.
Exit codes: 0 published, 2 features partition not published, 3 the model does not fit the features, 4 the
storage root cannot be read or written.
Executors need PYSPARK_PYTHON (or spark.pyspark.python) pointing at an interpreter with torch, pandas and
pyarrow.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridjobs import cli, objectstore, scoring  # noqa: E402
from hybridjobs.spark import build_session  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_partition_args(parser)
    cli.add_model_args(parser, scoring.DEFAULT_BATCH_SIZE, "TorchScript file readable by the executors")
    args = parser.parse_args(argv)
    cli.check_model_args(parser, args)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    spark = build_session("hybridflow-scoring")
    try:
        manifest = scoring.run(spark, args.root, args.ds, os.path.abspath(args.model), args.model_version,
                               args.batch_size)
    except cli.EXPECTED_FAILURES as err:
        return cli.failed("SCORING", f"ds={args.ds}", err)
    except objectstore.StorageError as err:
        return cli.storage_failed("SCORING", f"ds={args.ds}", err)
    finally:
        spark.stop()
    job = manifest["job"]
    print(f"SCORING ds={args.ds} rows={manifest['row_count']} model_version={args.model_version} "
          f"seconds={job['seconds']} rows_per_s={job['rows_per_s']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
