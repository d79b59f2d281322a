"""What the partition jobs' command lines share: the ``--root``/``--ds`` and model arguments, their checks, and the
exit codes a failure maps to (Airflow's operators and the runbooks read them). Imports no third-party package.
"""

from __future__ import annotations

import argparse
import os
import sys

from hybridjobs import storage
from hybridjobs.predictions import ModelContractError

# Exit code per failure a job expects: 2 its input partition is not published or its manifest is unreadable,
# 3 the model does not fit it.
EXIT_CODES: dict[type[Exception], int] = {storage.PartitionNotPublishedError: 2, storage.ManifestError: 2,
                                          ModelContractError: 3}
EXPECTED_FAILURES = tuple(EXIT_CODES)
# The storage root cannot be read or written (hybridjobs.objectstore.StorageError: a missing bucket, wrong keys, an
# endpoint that does not answer); the message names the URI and the fix, never a key.
STORAGE_FAILED = 4


def ds_argument(value: str) -> str:
    """``--ds`` as ISO text, or argparse's usage error naming the value."""
    try:
        return storage.parse_ds(value).isoformat()
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_partition_args(parser: argparse.ArgumentParser, *, required: bool = True,
                       root_help: str = "the storage root") -> None:
    parser.add_argument("--root", required=required, help=root_help)
    parser.add_argument("--ds", required=required, type=ds_argument, help="YYYY-MM-DD")


def add_model_args(parser: argparse.ArgumentParser, default_batch_size: int, model_help: str) -> None:
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--model-version", required=True)
    parser.add_argument("--batch-size", type=int, default=default_batch_size,
                        help="rows per batch handed to the model (default %(default)s)")


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse model arguments that would fail only after the job has started reading."""
    if not os.path.isfile(args.model):
        parser.error(f"--model {args.model} is not a file")
    if not args.model_version.strip():
        parser.error("--model-version must not be empty")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")


def failed(stage: str, what: str, err: Exception) -> int:
    """Say why the job failed on stderr and return its exit code."""
    print(f"{stage} FAILED {what}: {err}", file=sys.stderr, flush=True)
    return next(code for kind, code in EXIT_CODES.items() if isinstance(err, kind))


def storage_failed(stage: str, what: str, err: Exception) -> int:
    """Say which URI the job could not read or write, and how to fix it, on stderr; return STORAGE_FAILED."""
    print(f"{stage} FAILED {what}: {err}", file=sys.stderr, flush=True)
    return STORAGE_FAILED
