"""Feature engineering for one daily partition: raw events (+ look-back) -> features and quarantine.

Usage:
  spark-submit jobs/build_features.py --root /var/lib/hybridflow/storage --ds 2026-01-05 [--lookback-days 28]

Reads <root>/raw/ds=<ds>/ (required) and the published raw partitions of the look-back days before it
(those missing are listed in the manifest), publishes <root>/quarantine/ds=<ds>/ and then
<root>/features/ds=<ds>/, each with _MANIFEST.json and _SUCCESS, replacing an earlier run of the same ds.
--root is a local path or s3://bucket/prefix (no Hadoop S3 connector needed: hybridjobs/datasets.py).
Prints one `FEATURES ...` line.
Exit codes: 0 published, 2 the raw partition of the ds is not published, 4 the storage root cannot be read or
written (the message names the URI and the fix). Never imports Airflow.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridjobs import cli, features, objectstore  # noqa: E402
from hybridjobs.spark import build_session  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_partition_args(parser, root_help="storage root holding raw/, features/, quarantine/")
    parser.add_argument("--lookback-days", type=int, default=features.DEFAULT_LOOKBACK_DAYS,
                        help="raw partitions read, ending at --ds (default %(default)s)")
    args = parser.parse_args(argv)
    if args.lookback_days < 1:
        parser.error("--lookback-days must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    spark = build_session("hybridflow-features")
    try:
        manifest = features.run(spark, args.root, args.ds, args.lookback_days)
    except cli.EXPECTED_FAILURES as err:
        return cli.failed("FEATURES", f"ds={args.ds}", err)
    except objectstore.StorageError as err:
        return cli.storage_failed("FEATURES", f"ds={args.ds}", err)
    finally:
        spark.stop()
    q = manifest["quarantine"]
    print(f"FEATURES ds={args.ds} rows={manifest['row_count']} raw_rows={manifest['input']['raw_rows']} "
          f"quarantined={q['rows']} quarantine_ratio={q['ratio']} seconds={manifest['job']['seconds']}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
