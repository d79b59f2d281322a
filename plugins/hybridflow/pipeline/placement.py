"""CPU or GPU: where a training run and an evaluation run, decided from measured figures.

Training (:func:`training_placement`), for a model preset and what the run asks for (``device``):

- ``device=gpu`` or ``device=cpu`` wins: the run asked for it.
- ``device=auto``: each side's cost per 1,000 rows is the hourly price of what one rank holds (on the GPU side one
  GPU and ``cpus_per_task`` cores, on the CPU side the cores alone; ``costs`` in pipeline.yaml) over the rows one
  rank trains in an hour (``placement.training.<preset>``, measured). The GPU wins when it is at least
  ``placement.min_gpu_speedup`` times faster (the time it saves is worth its price); otherwise the side with the
  lower cost per 1,000 rows wins (a tie keeps the GPU).
- A preset without a figure for a side keeps the GPU, the default, and says which figure is not measured.

The CPU side runs the same ranks (``nodes`` x ``gpus`` of the run) as processes on the CPU partition, without GRES.

Evaluation (:func:`evaluation_placement`): scoring both models on the holdout is (challenger + champion
parameters) x holdout rows of work; at the measured CPU rate (``placement.evaluation``), a job estimated over
``max_cpu_s`` runs on the GPU partition with ``gpus`` GPU(s), else on the CPU partition. Without a rate, or without
the holdout size, it stays on the CPU partition (the default), saying what is not measured.

Pure: the figures come in, a decision with its one-line reason comes out (the task log and the run report show
both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hybridflow.config import DEVICES, CostConfig, EvaluationPlacementConfig, PlacementConfig

SIDES = ("cpu", "gpu")


def mlp_parameters(n_features: int, hidden_sizes: Sequence[int]) -> int:
    """Weights and biases of the preset's network (jobs/hybridtrain/model.py: Linear per hidden width, one logit)."""
    total, width = 0, n_features
    for hidden in (*hidden_sizes, 1):
        total += width * hidden + hidden
        width = hidden
    return total


def usd_per_1k_rows(rows_per_s: float | None, usd_per_hour: float) -> float | None:
    return None if rows_per_s is None else usd_per_hour / (rows_per_s * 3600) * 1000


def rank_usd_per_hour(side: str, cpus_per_task: int, costs: CostConfig) -> float:
    """What one rank holds for an hour: its cores, and on the GPU side its GPU."""
    return cpus_per_task * costs.cpu_hour_usd + (costs.gpu_hour_usd if side == "gpu" else 0.0)


def rows_text(rows_per_s: float) -> str:
    """``17.6k rows/s``, ``40k rows/s``, ``1.2M rows/s``."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rows_per_s >= scale:
            return f"{rows_per_s / scale:.3g}{suffix} rows/s"
    return f"{rows_per_s:.3g} rows/s"


def usd_text(usd: float) -> str:
    """Two significant digits without an exponent: ``$0.0000016``, ``$0.028``, ``$12``."""
    if usd <= 0:
        return "$0"
    decimals = max(0, 1 - math.floor(math.log10(usd)))
    return f"${usd:.{decimals}f}"


def times_text(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def count_text(value: float) -> str:
    return rows_text(value).removesuffix(" rows/s")


def seconds_text(seconds: float) -> str:
    """``99 s``, ``2.5 s``, ``0.24 s``, ``0.00022 s``."""
    if seconds >= 10:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    return usd_text(seconds).removeprefix("$") + " s"


def magnitude_text(value: float) -> str:
    """``5.5e12``: two significant digits, a plain exponent."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


@dataclass(frozen=True)
class SideFigures:
    """One side's figures for a preset: measured rows/s per rank, what a rank costs, the cost per 1,000 rows."""

    side: str
    rows_per_s: float | None
    usd_per_hour: float
    usd_per_1k_rows: float | None
    measured: str

    def text(self) -> str:
        if self.rows_per_s is None:
            return f"{self.side.upper()} not measured"
        return f"{self.side.upper()} {rows_text(self.rows_per_s)} at {usd_text(self.usd_per_1k_rows)} per 1k rows"


@dataclass(frozen=True)
class TrainingPlacement:
    """Where a training run goes and why. ``rule``: requested, not-measured, gpu-speedup or cheaper."""

    preset: str
    device: str
    side: str
    partition: str
    gpus_per_node: int
    ranks_per_node: int
    rule: str
    reason: str
    cpu: SideFigures
    gpu: SideFigures
    gpu_speedup: float | None
    min_gpu_speedup: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def side_figures(side: str, placement: PlacementConfig, preset: str, costs: CostConfig,
                 cpus_per_task: int) -> SideFigures:
    rates = placement.training.get(preset)
    rate = getattr(rates, side) if rates is not None else None
    usd_per_hour = rank_usd_per_hour(side, cpus_per_task, costs)
    rows_per_s = rate.rows_per_s if rate is not None else None
    measured = rate.measured if rate is not None else f"not measured: no placement.training.{preset} in pipeline.yaml"
    return SideFigures(side, rows_per_s, usd_per_hour, usd_per_1k_rows(rows_per_s, usd_per_hour), measured)


def training_placement(preset: str, device: str, ranks_per_node: int, *, placement: PlacementConfig,
                       costs: CostConfig, cpus_per_task: int, gpu_partition: str) -> TrainingPlacement:
    """The side, partition and GPUs per node of a training run of ``preset`` (see the module's rule).

    :param device: the run's request: auto, gpu or cpu.
    :param ranks_per_node: the run's ranks per node (``gpus``): one per GPU on the GPU side, as many CPU processes
        on the CPU side.
    :raises ValueError: a device that is not one of :data:`~hybridflow.config.DEVICES`.
    """
    if device not in DEVICES:
        raise ValueError(f"param device={device!r}: choose one of {', '.join(DEVICES)}")
    cpu = side_figures("cpu", placement, preset, costs, cpus_per_task)
    gpu = side_figures("gpu", placement, preset, costs, cpus_per_task)
    speedup = gpu.rows_per_s / cpu.rows_per_s if cpu.rows_per_s and gpu.rows_per_s else None
    figures = f"{preset}: {cpu.text()} vs {gpu.text()}"
    if device != "auto":
        side, rule, why = device, "requested", f"{figures}; device={device} requested"
    elif speedup is None:
        missing = " and ".join(s.side.upper() for s in (cpu, gpu) if s.rows_per_s is None)
        side, rule = "gpu", "not-measured"
        why = (f"{preset}: {missing} training throughput not measured (pipeline.yaml placement.training); keeps "
               "the GPU, the default")
    elif speedup >= placement.min_gpu_speedup:
        side, rule = "gpu", "gpu-speedup"
        why = f"{figures}: GPU {times_text(speedup)} faster (>= min_gpu_speedup {placement.min_gpu_speedup:g})"
    elif gpu.usd_per_1k_rows <= cpu.usd_per_1k_rows:
        side, rule = "gpu", "cheaper"
        why = (f"{figures}: GPU {times_text(cpu.usd_per_1k_rows / gpu.usd_per_1k_rows)} cheaper per row and "
               f"{times_text(speedup)} faster")
    else:
        side, rule = "cpu", "cheaper"
        speed = (f"GPU only {times_text(speedup)} faster" if speedup >= 1
                 else f"GPU {times_text(1 / speedup)} slower")
        why = (f"{figures}: CPU {times_text(gpu.usd_per_1k_rows / cpu.usd_per_1k_rows)} cheaper, {speed} "
               f"(< min_gpu_speedup {placement.min_gpu_speedup:g})")
    partition = gpu_partition if side == "gpu" else placement.cpu_partition
    gpus = ranks_per_node if side == "gpu" else 0
    return TrainingPlacement(
        preset=preset, device=device, side=side, partition=partition, gpus_per_node=gpus,
        ranks_per_node=ranks_per_node, rule=rule, reason=f"{why} -> {partition} partition", cpu=cpu, gpu=gpu,
        gpu_speedup=speedup, min_gpu_speedup=placement.min_gpu_speedup,
    )


@dataclass(frozen=True)
class EvaluationPlacement:
    """Where the champion/challenger evaluation job runs and why. ``rule``: requested, not-measured, cpu-fast or
    cpu-slow."""

    side: str
    partition: str
    gpus_per_node: int
    rule: str
    reason: str
    challenger_parameters: int
    champion_parameters: int | None
    holdout_rows: int | None
    parameter_rows: float | None
    cpu_s: float | None
    gpu_s: float | None
    max_cpu_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def holdout_rows(row_counts: Iterable[int | None], fraction: float) -> int | None:
    """The holdout's expected size: ``fraction`` of the window's feature rows (None when a count is unknown)."""
    counts = list(row_counts)
    if not counts or any(c is None for c in counts):
        return None
    return round(sum(counts) * fraction)


def evaluation_placement(challenger_parameters: int, champion_parameters: int | None, rows: int | None, *,
                         config: EvaluationPlacementConfig, cpu_partition: str, gpu_partition: str,
                         device: str = "auto") -> EvaluationPlacement:
    """The partition of the evaluation job (see the module's rule). ``device=cpu`` keeps it on the CPU partition;
    ``gpu`` and ``auto`` let the scoring cost decide (a small pair needs no GPU).

    :param champion_parameters: 0 when there is no champion; None when its size is not recorded (an export from
        before the job wrote it): the estimate then covers the challenger alone and says so.
    :param rows: the holdout's expected rows (:func:`holdout_rows`), None when not known.
    """
    models = f"challenger {count_text(challenger_parameters)}"
    if champion_parameters is None:
        models += " parameters (the champion's size is not recorded: not counted)"
    elif champion_parameters:
        models += f" + champion {count_text(champion_parameters)} parameters"
    else:
        models += " parameters (no champion)"
    work = None if rows is None else (challenger_parameters + (champion_parameters or 0)) * rows
    cpu_s = None if work is None or not config.cpu_parameter_rows_per_s else work / config.cpu_parameter_rows_per_s
    gpu_s = None if work is None or not config.gpu_parameter_rows_per_s else work / config.gpu_parameter_rows_per_s
    gpu_text = "" if gpu_s is None else f", ~{seconds_text(gpu_s)} on a GPU"
    if device == "cpu":
        side, rule, why = "cpu", "requested", f"evaluation: {models}; device=cpu requested"
    elif work is None:
        side, rule = "cpu", "not-measured"
        why = (f"evaluation: {models} x holdout rows not measured (a features manifest without row_count); the "
               "CPU partition, the default")
    elif cpu_s is None:
        side, rule = "cpu", "not-measured"
        why = (f"evaluation: {models} x {count_text(rows)} holdout rows; CPU scoring rate not measured "
               "(placement.evaluation.cpu_parameter_rows_per_s); the CPU partition, the default")
    else:
        estimate = (f"evaluation: {models} x {count_text(rows)} holdout rows = {magnitude_text(work)} "
                    f"parameter-rows: ~{seconds_text(cpu_s)} on CPU at "
                    f"{magnitude_text(config.cpu_parameter_rows_per_s)}/s{gpu_text}")
        if cpu_s > config.max_cpu_s:
            side, rule, why = "gpu", "cpu-slow", f"{estimate} (> max_cpu_s {config.max_cpu_s:g})"
        else:
            side, rule, why = "cpu", "cpu-fast", f"{estimate} (<= max_cpu_s {config.max_cpu_s:g})"
    partition = gpu_partition if side == "gpu" else cpu_partition
    return EvaluationPlacement(
        side=side, partition=partition, gpus_per_node=config.gpus if side == "gpu" else 0, rule=rule,
        reason=f"{why} -> {partition} partition", challenger_parameters=challenger_parameters,
        champion_parameters=champion_parameters, holdout_rows=rows, parameter_rows=work, cpu_s=cpu_s, gpu_s=gpu_s,
        max_cpu_s=config.max_cpu_s,
    )
