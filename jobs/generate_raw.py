"""Deterministic raw customer events for one daily partition (numpy + pyarrow; no Spark needed).

Usage:
  python jobs/generate_raw.py --root /var/lib/hybridflow/storage --ds 2026-01-05 --rows 1000000 \
      [--customers 50000] [--malformed-share 0.02] [--defect-weights bad_amount_type=2,negative_amount=0] \
      [--population-seed 7] [--rows-per-file 500000]
(`spark-submit jobs/generate_raw.py ...` works too; it runs the same code on the driver.)

Publishes <root>/raw/ds=<ds>/ (the tables events and labels as Parquet, _MANIFEST.json naming every part and
the defects planted per kind, then _SUCCESS), replacing an earlier partition of the same ds. --root is a local
path or s3://bucket/prefix (credentials: hybridjobs/objectstore.py). Prints one `RAW ...` line. Exit codes: 0
published, 2 bad arguments, 4 the storage root cannot be read or written. Never imports Airflow.
"""

import argparse
import os
import sys
import time

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridjobs import cli, objectstore, partitions, storage  # noqa: E402
from hybridjobs.generator import RAW_COLUMNS, GeneratorConfig, generate_partition, parse_defect_weights  # noqa: E402

RAW_MANIFEST_COLUMNS = [{"name": c, "type": "binary"} for c in RAW_COLUMNS]


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


def job_section(args: argparse.Namespace, started: float) -> dict:
    seconds = round(time.monotonic() - started, 3)
    return {"name": "generate_raw", "seconds": seconds, "rows_per_s": round(args.rows / seconds, 1)}


def publish_to_folder(args: argparse.Namespace, config: GeneratorConfig, started: float) -> dict:
    """The tables as Parquet folders in a staging folder, renamed into place (hybridjobs/storage.py)."""
    target = storage.partition_dir(args.root, "raw", args.ds)
    staging = storage.new_staging_dir(target)
    details = generate_partition(staging, args.ds, config)
    manifest = storage.base_manifest("raw", args.ds, args.rows, RAW_MANIFEST_COLUMNS, job_section(args, started))
    manifest.update(details, files=storage.data_files(staging))
    storage.publish(staging, target, manifest)
    return details


def publish_to_object_store(args: argparse.Namespace, config: GeneratorConfig, started: float) -> dict:
    """The tables as parts of one attempt, committed by their manifest (hybridjobs/objectstore.py)."""
    partition = objectstore.open_uri(f"{args.root.rstrip('/')}/raw/ds={args.ds}")
    attempt, parts, schemas = objectstore.new_attempt(), [], {}

    def write(table_name: str, index: int, table: pa.Table) -> None:
        parts.append(objectstore.write_part(partition, attempt, index, table, table_name=table_name))
        schemas[table_name] = table.schema

    details = generate_partition(write, args.ds, config)
    fields = storage.base_manifest("raw", args.ds, args.rows, RAW_MANIFEST_COLUMNS, job_section(args, started))
    objectstore.commit_partition(partition, parts, {**fields, **details}, schema=schemas)
    return details


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
    publish = publish_to_object_store if args.root.startswith("s3://") else publish_to_folder
    try:
        if args.skip_if_published and partitions.is_published(args.root, "raw", args.ds):
            print(f"RAW ds={args.ds} already published under {args.root}; left as it is", flush=True)
            return 0
        details = publish(args, config, started)
    except objectstore.StorageError as err:
        return cli.storage_failed("RAW", f"ds={args.ds}", err)
    seconds = round(time.monotonic() - started, 3)
    print(f"RAW ds={args.ds} rows={args.rows} customers={config.n_customers} "
          f"planted_defects={details['planted_defects_total']} seconds={seconds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
