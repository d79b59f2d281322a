"""The training job's exceptions and process exit codes: one place, so the Slurm operator can rely on them."""

from __future__ import annotations

import re
from enum import IntEnum

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "ExitCode",
    "FeatureDataError",
    "RequeueError",
    "ResumeError",
    "TrainingJobError",
    "collective_failure",
]

# What torch.distributed raises when a peer is gone or stuck: gloo's per-operation timeout and broken
# connections, the rendezvous store's timeout, NCCL's watchdog (when it raises rather than aborts).
_COLLECTIVE_FAILURE_RE = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|waiting for clients|DistBackendError|DistStoreError"
    r"|Watchdog caught collective operation timeout|NCCL communicator was aborted",
)


class ExitCode(IntEnum):
    """How ``jobs/train.py`` ends.

    ``OK``: training finished (metrics, final checkpoint and export written), or a SIGUSR2 stop under Slurm
    checkpointed and requeued the job (Slurm then shows the job REQUEUED, not COMPLETED).
    ``FAILED``: an unexpected error; the traceback is on stderr.
    ``INVALID_INPUT``: the run config, the DeepSpeed config, the model presets or the feature partitions are
    invalid; the message names the field or the partition. Retrying does not help.
    ``STOPPED``: SIGUSR2 without ``SLURM_JOB_ID``: a checkpoint was saved and the job stopped without
    requeueing (75 is EX_TEMPFAIL: run the same command again to resume).
    ``REQUEUE_FAILED``: SIGUSR2 under Slurm: the checkpoint was saved but ``scontrol requeue`` failed.
    ``TERMINATED``: SIGTERM (``scancel``, the time limit, a preemption): a checkpoint was saved and the job
    stopped without requeueing itself (128 + SIGTERM, as a shell reports it).
    """

    OK = 0
    FAILED = 1
    INVALID_INPUT = 2
    STOPPED = 75
    REQUEUE_FAILED = 76
    TERMINATED = 143


class TrainingJobError(Exception):
    """Base of the errors the job reports without a traceback."""

    exit_code = ExitCode.FAILED


class ConfigError(TrainingJobError):
    """The run config, the DeepSpeed config or the model presets are invalid; the message names each field."""

    exit_code = ExitCode.INVALID_INPUT


class FeatureDataError(TrainingJobError):
    """A feature partition is missing, unfinished or does not match the contract; the message names it."""

    exit_code = ExitCode.INVALID_INPUT


class ResumeError(TrainingJobError):
    """The run directory holds checkpoints of a different training plan, so resuming would not be faithful."""

    exit_code = ExitCode.INVALID_INPUT


class CheckpointError(TrainingJobError):
    """A checkpoint could not be completed (a rank's shard is not visible where the manifest is written)."""


class CollectiveError(TrainingJobError):
    """A collective (or the rendezvous) failed: another rank is dead, stuck or unreachable."""


def collective_failure(text: str, timeout_s: float) -> CollectiveError | None:
    """The job's error for a torch.distributed failure described by ``text`` (``"<type>: <message>"``), or None
    when ``text`` is not one: the first line only, since gloo's messages run on with advice."""
    if not _COLLECTIVE_FAILURE_RE.search(text):
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else text
    return CollectiveError(
        f"a collective operation failed (collective_timeout_s={timeout_s:g}): another rank is dead, stuck or "
        f"unreachable; the other ranks' log lines (rank<r>@<node>) and the Slurm job's state name it. "
        f"{first_line}"
    )


class RequeueError(TrainingJobError):
    """``scontrol requeue`` failed after the preemption checkpoint was saved."""

    exit_code = ExitCode.REQUEUE_FAILED
