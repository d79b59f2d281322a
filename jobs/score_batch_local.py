"""Batch scoring of one features partition with a TorchScript model, without Spark: the Slurm GPU route's job.

Usage:
  python jobs/score_batch_local.py --root /var/lib/hybridflow/storage --ds 2026-01-05 \
      --model /var/lib/hybridflow/storage/models/propensity/v7/model.pt --model-version v7 \
      [--batch-size 65536] [--device auto|cpu|cuda] [--precision auto|fp32|bf16]
  python jobs/score_batch_local.py --probe-rows 100000 --model .../model.pt --model-version v7 [--device ...]

Scores on the GPU the job was given (CUDA_VISIBLE_DEVICES; `auto` falls back to the CPUs Slurm gave it) and
publishes <root>/predictions/ds=<ds>/ exactly as jobs/score_batch.py does (customer_id, score float32,
model_version; _MANIFEST.json with the model's version and sha256 and the device, then _SUCCESS), replacing an
earlier run of the same ds. Prints one `SCORING ... rows_per_s=...` line. `--probe-rows N` scores N synthetic rows
instead and publishes nothing (the GPU side's check when there is no ds to score): `SCORING PROBE ...`.
Precision: `auto` scores in bf16 on a GPU when the model's export check allowed it (signature.json "precision":
max |p_bf16 - p_fp32| <= 0.01 and AUC difference <= 0.001), else in float32; the manifest records the precision
and the check's figures.
Exit codes: 0 published (or probed), 2 features partition not published, its manifest unreadable (or bad
arguments), 3 the model does not fit the features (or bf16 asked for where its export check did not allow it).
Needs torch, numpy and pyarrow (the cluster's job environment); never imports pyspark or Airflow.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridjobs import cli, local_scoring  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_partition_args(parser, required=False, root_help="the storage root (--root and --ds are required "
                           "unless --probe-rows)")
    cli.add_model_args(parser, local_scoring.DEFAULT_BATCH_SIZE, "TorchScript file")
    parser.add_argument("--device", choices=local_scoring.DEVICES, default="auto",
                        help="auto: the GPU when torch sees one, else the CPU (default %(default)s)")
    parser.add_argument("--precision", choices=local_scoring.PRECISION_CHOICES, default="auto",
                        help="auto: bf16 on a GPU where the model's export check allowed it, else fp32 "
                             "(default %(default)s)")
    parser.add_argument("--probe-rows", type=int, default=None,
                        help="score this many synthetic rows and publish nothing, instead of --root/--ds")
    args = parser.parse_args(argv)
    if args.probe_rows is None and not (args.root and args.ds):
        parser.error("--root and --ds are required (or --probe-rows for a probe)")
    if args.probe_rows is not None and (args.root or args.ds):
        parser.error("--probe-rows scores synthetic rows: give it without --root and --ds")
    if args.probe_rows is not None and args.probe_rows < 1:
        parser.error("--probe-rows must be >= 1")
    cli.check_model_args(parser, args)
    try:
        args.device = local_scoring.resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model = os.path.abspath(args.model)
    what = f"probe rows={args.probe_rows}" if args.probe_rows else f"ds={args.ds}"
    try:
        if args.probe_rows:
            job = local_scoring.probe(model, args.model_version, args.probe_rows, args.batch_size, args.device,
                                      args.precision)
            print(f"SCORING PROBE rows={job['rows']} model_version={args.model_version} device={job['device']} "
                  f"precision={job['precision']} seconds={job['seconds']} rows_per_s={job['rows_per_s']}",
                  flush=True)
            return 0
        manifest = local_scoring.run(args.root, args.ds, model, args.model_version, args.batch_size, args.device,
                                     args.precision)
    except cli.EXPECTED_FAILURES as err:
        return cli.failed("SCORING", what, err)
    job = manifest["job"]
    print(f"SCORING ds={args.ds} rows={manifest['row_count']} model_version={args.model_version} "
          f"device={job['device']} precision={job['precision']} seconds={job['seconds']} "
          f"rows_per_s={job['rows_per_s']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
