"""The all-reduce share of a training step, measured inside the training loop, and its summary for metrics.json.

Every ``allreduce_sample_every_steps`` optimizer steps (the step numbers are the same on every rank, so every
rank takes part in the same collectives) each rank times one whole optimizer step (every micro-batch's forward
and backward, and the optimizer step, DeepSpeed's own gradient reduction included; CUDA synchronised before
reading the clock), then, after a barrier, one ``dist.all_reduce`` of a float32 buffer with as many elements as
the model has trainable parameters: the gradient volume a data-parallel step reduces. A sample is the slowest
rank's figures (a MAX all-reduce of both), since the slowest rank sets the pace of a synchronous step. The
share is median(all-reduce) / median(step). With one rank there is no gradient all-reduce: the share is null
with the reason, never a 0 that looks measured. Standard library only.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["METHOD", "is_sample_step", "summarise_allreduce"]

METHOD = (
    "every {every} optimizer steps, the slowest rank's wall time of one step (forward, backward and optimizer "
    "step, DeepSpeed's gradient reduction included, CUDA synchronised) and of one dist.all_reduce of a float32 "
    "buffer of {elements} elements (the trainable parameters: a data-parallel step's gradient volume) on the "
    "job's process group after a barrier, all ranks together; share = median(all-reduce) / median(step)"
)


def is_sample_step(step: int, every_steps: int) -> bool:
    """Whether 0-based optimizer ``step`` is measured: the one that completes a multiple of ``every_steps``.

    It depends only on the step number, so every rank decides alike; the first step of a run (allocations,
    warm-up) is measured only when ``every_steps`` is 1.
    """
    return (step + 1) % every_steps == 0


def summarise_allreduce(
    samples: Sequence[Sequence[float | None]],
    *,
    every_steps: int,
    world_size: int,
    elements: int,
) -> dict[str, object]:
    """The ``allreduce`` section of metrics.json.

    :param samples: ``[step, step_ms, comm_ms]`` per measured step (``step`` 1-based, ``comm_ms`` None with one
        rank).
    :param every_steps: ``allreduce_sample_every_steps``.
    :param elements: the all-reduced buffer's element count (the model's trainable parameters).
    """
    step_ms = [float(sample[1]) for sample in samples]
    comm_ms = [float(sample[2]) for sample in samples if sample[2] is not None]
    summary: dict[str, object] = {
        "share": None,
        "comm_ms_median": round(statistics.median(comm_ms), 3) if comm_ms else None,
        "step_ms_median": round(statistics.median(step_ms), 3) if step_ms else None,
        "samples": len(samples),
        "every_steps": every_steps,
        "world_size": world_size,
        "elements": elements,
        "method": METHOD.format(every=every_steps, elements=elements),
        "series": [[int(sample[0]), sample[1], sample[2]] for sample in samples],
    }
    if world_size == 1:
        summary["reason"] = "one rank: no gradient all-reduce"
    elif not samples:
        summary["reason"] = (
            f"no step was measured: the run took fewer than allreduce_sample_every_steps={every_steps} steps"
        )
    elif not comm_ms or summary["step_ms_median"] <= 0:
        summary["reason"] = "the samples have no all-reduce or step time"
    else:
        summary["share"] = round(statistics.median(comm_ms) / statistics.median(step_ms), 4)
    return summary
