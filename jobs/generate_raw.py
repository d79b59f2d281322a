"""Deterministic raw customer events for one daily partition (numpy + pyarrow; no Spark needed).

Usage:
  python jobs/generate_raw.py --root /var/lib/hybridflow/storage --ds 2026-01-05 --rows 1000000 \
      [--customers 50000] [--malformed-share 0.02] [--defect-weights bad_amount_type=2,negative_amount=0] \
      [--population-seed 7] [--rows-per-file 500000]
(`spark-submit jobs/generate_raw.py ...` works too; it runs the same code on the driver.)

Publishes <root>/raw/ds=<ds>/ (events/ and labels/ Parquet, _MANIFEST.json with the defects planted per
kind, then _SUCCESS), replacing an earlier partition of the same ds. Prints one `RAW ...` line. Never imports
Airflow.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridjobs import cli, storage  # noqa: E402
from hybridjobs.generator import RAW_COLUMNS, GeneratorConfig, generate_partition, parse_defect_weights  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_partition_args(parser)
    parser.add_argument("--rows", required=True, type=int)
    parser.add_argument("--customers", type=int, default=None, help="population size (default rows // 20)")
    parser.add_argument("--malformed-share", type=float, default=0.02, help="share of rows with one defect")
    parser.add_argument("--defect-weights", default=None, help="kind=weight,... (unnamed kinds weigh 1)")
    parser.add_argument("--population-seed", type=int, default=7)
    parser.add_argument("--rows-per-file", type=int, default=500_000)
    parser.add_argument("--skip-if-published", action="store_true",
                        help="leave an already published partition as it is (the generator is deterministic)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        config = GeneratorConfig(
            rows=args.rows, customers=args.customers, malformed_share=args.malformed_share,
            defect_weights=parse_defect_weights(args.defect_weights), population_seed=args.population_seed,
            rows_per_file=args.rows_per_file,
        )
    except ValueError as err:
        print(f"RAW FAILED: {err}", file=sys.stderr)
        return 2
    started = time.monotonic()
    target = storage.partition_dir(args.root, "raw", args.ds)
    if args.skip_if_published and storage.is_published(target):
        print(f"RAW ds={args.ds} already published at {target}; left as it is", flush=True)
        return 0
    staging = storage.new_staging_dir(target)
    details = generate_partition(staging, args.ds, config)
    seconds = round(time.monotonic() - started, 3)
    job = {"name": "generate_raw", "seconds": seconds, "rows_per_s": round(args.rows / seconds, 1)}
    manifest = storage.base_manifest(
        "raw", args.ds, args.rows, [{"name": c, "type": "binary"} for c in RAW_COLUMNS], job
    )
    manifest.update(details, files=storage.data_files(staging))
    storage.publish(staging, target, manifest)
    print(f"RAW ds={args.ds} rows={args.rows} customers={config.n_customers} "
          f"planted_defects={details['planted_defects_total']} seconds={seconds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
