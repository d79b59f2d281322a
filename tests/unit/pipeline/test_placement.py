"""CPU or GPU by tables (hybridflow.pipeline.placement): what a run asks for wins; auto takes the GPU when it is
min_gpu_speedup times faster, else the side cheaper per 1,000 rows; a preset without figures keeps the GPU and
says what is not measured; the evaluation goes to the GPU when its scoring is estimated over max_cpu_s on CPU."""

from __future__ import annotations

import math

import pytest
from hybridflow.config import (
    CostConfig,
    EvaluationPlacementConfig,
    MeasuredRate,
    PlacementConfig,
    PresetRates,
    load_pipeline_config,
)
from hybridflow.pipeline.placement import (
    evaluation_placement,
    holdout_rows,
    mlp_parameters,
    rows_text,
    training_placement,
    usd_per_1k_rows,
    usd_text,
)

PRICES = CostConfig(gpu_hour_usd=4.0, cpu_hour_usd=0.05)
CPUS = 2  # cores a rank holds on either side


def rates(cpu: float | None, gpu: float | None) -> PresetRates:
    return PresetRates(cpu=MeasuredRate(cpu, "cpu: test figure"), gpu=MeasuredRate(gpu, "gpu: test figure"))


PLACEMENT = PlacementConfig(cpu_partition="cpu", min_gpu_speedup=10.0, training={
    "small": rates(14_100, 40_000),      # GPU 2.8x faster, CPU 14x cheaper -> cpu
    "large": rates(376, 490_000),        # GPU 1300x faster -> gpu
    "mid": rates(1_000, 10_000),         # exactly min_gpu_speedup -> gpu
    "dense": rates(1_000, 9_000),        # 9x faster, GPU rank 41x the price -> cpu
    "odd": rates(100_000, 400_000),      # 4x faster but the GPU rank costs only 1.1x (cheap GPU prices below)
    "slow-gpu": rates(80_000, 40_000),   # the GPU is slower -> cpu
    "cpu-only": rates(14_100, None),
    "gpu-only": rates(None, 40_000),
})


def place(preset: str, device: str = "auto", ranks: int = 2, placement: PlacementConfig = PLACEMENT,
          costs: CostConfig = PRICES):
    return training_placement(preset, device, ranks, placement=placement, costs=costs, cpus_per_task=CPUS,
                              gpu_partition="gpu-training")


@pytest.mark.parametrize("preset, device, side, rule, fragments", [
    ("small", "auto", "cpu", "cheaper", ["CPU 14.1k rows/s at $0.0000020 per 1k rows",
                                         "GPU 40k rows/s at $0.000028 per 1k rows", "CPU 14x cheaper",
                                         "GPU only 2.8x faster (< min_gpu_speedup 10)", "-> cpu partition"]),
    ("small", "gpu", "gpu", "requested", ["device=gpu requested", "-> gpu-training partition"]),
    ("small", "cpu", "cpu", "requested", ["device=cpu requested", "-> cpu partition"]),
    ("large", "auto", "gpu", "gpu-speedup", ["GPU 1303x faster (>= min_gpu_speedup 10)", "-> gpu-training"]),
    ("large", "cpu", "cpu", "requested", ["device=cpu requested", "-> cpu partition"]),
    ("mid", "auto", "gpu", "gpu-speedup", ["GPU 10x faster (>= min_gpu_speedup 10)"]),
    ("dense", "auto", "cpu", "cheaper", ["CPU 4.6x cheaper, GPU only 9.0x faster"]),
    ("slow-gpu", "auto", "cpu", "cheaper", ["CPU 82x cheaper, GPU 2.0x slower (< min_gpu_speedup 10)"]),
    ("cpu-only", "auto", "gpu", "not-measured", ["GPU training throughput not measured", "keeps the GPU"]),
    ("gpu-only", "auto", "gpu", "not-measured", ["CPU training throughput not measured", "keeps the GPU"]),
    ("gpu-only", "cpu", "cpu", "requested", ["CPU not measured vs GPU 40k rows/s", "device=cpu requested"]),
    ("tiny", "auto", "gpu", "not-measured", ["CPU and GPU training throughput not measured", "-> gpu-training"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_placement_training_rule(preset, device, side, rule, fragments):
    decided = place(preset, device)
    assert (decided.side, decided.rule, decided.preset, decided.device) == (side, rule, preset, device)
    assert decided.partition == ("gpu-training" if side == "gpu" else "cpu")
    for fragment in fragments:
        assert fragment in decided.reason, decided.reason


@pytest.mark.parametrize("side, gpus", [("gpu", 2), ("cpu", 0)])
def test_placement_cpu_side_asks_for_no_gpu_and_keeps_the_ranks(side, gpus):
    """The CPU side runs the run's ranks per node as CPU processes: no GRES, the same ranks."""
    decided = place("small", side, ranks=2)
    assert (decided.gpus_per_node, decided.ranks_per_node) == (gpus, 2)


def test_placement_gpu_wins_when_it_is_cheaper_per_row():
    """4x faster at 1.1x the price of a CPU rank (a GPU priced at 0.01 USD/h): the GPU is cheaper per row."""
    cheap_gpu = CostConfig(gpu_hour_usd=0.01, cpu_hour_usd=0.05)
    decided = place("odd", costs=cheap_gpu)
    assert (decided.side, decided.rule) == ("gpu", "cheaper")
    assert "GPU 3.6x cheaper per row and 4.0x faster" in decided.reason


def test_placement_costs_per_1000_rows_are_the_rank_price_over_its_rows():
    """A GPU rank holds one GPU and CPUS cores; a CPU rank the cores alone (prices from `costs`)."""
    decided = place("small")
    assert math.isclose(decided.cpu.usd_per_hour, CPUS * 0.05)
    assert math.isclose(decided.gpu.usd_per_hour, 4.0 + CPUS * 0.05)
    assert math.isclose(decided.cpu.usd_per_1k_rows, 0.1 / (14_100 * 3600) * 1000)
    assert math.isclose(decided.gpu.usd_per_1k_rows, 4.1 / (40_000 * 3600) * 1000)
    assert math.isclose(decided.gpu_speedup, 40_000 / 14_100)
    assert (decided.cpu.measured, decided.gpu.measured) == ("cpu: test figure", "gpu: test figure")


def test_placement_as_dict_is_json_ready_for_xcom():
    import json

    data = place("small").as_dict()
    assert json.loads(json.dumps(data)) == data
    assert {"side", "partition", "gpus_per_node", "ranks_per_node", "reason", "cpu", "gpu"} <= set(data)


def test_placement_refuses_an_unknown_device_naming_the_param():
    with pytest.raises(ValueError, match=r"param device='tpu': choose one of auto, gpu, cpu"):
        place("small", "tpu")


def test_placement_preset_missing_from_the_config_is_not_measured_on_both_sides():
    decided = place("small", placement=PlacementConfig())
    assert (decided.side, decided.rule) == ("gpu", "not-measured")
    assert decided.cpu.rows_per_s is None and "no placement.training.small" in decided.cpu.measured


@pytest.mark.parametrize("preset, device, side", [
    ("small", "auto", "cpu"),   # the issue: the small preset does not take a GPU
    ("small", "gpu", "gpu"),
    ("large", "auto", "gpu"),
    ("tiny", "auto", "gpu"),    # not measured on a GPU: the default
])
def test_placement_with_the_checked_in_figures(preset, device, side):
    config = load_pipeline_config()
    decided = training_placement(preset, device, 1, placement=config.placement, costs=config.costs,
                                 cpus_per_task=config.nightly.cpus_per_task, gpu_partition=config.cluster.partition)
    assert decided.side == side, decided.reason


@pytest.mark.parametrize("hidden, parameters", [
    ((16,), 31 * 16 + 16 + 16 + 1),
    ((128, 64), 12_417),
    ((4096, 4096, 2048, 1024), 27_402_241),
])
def test_placement_counts_the_presets_parameters(hidden, parameters):
    assert mlp_parameters(31, hidden) == parameters


@pytest.mark.parametrize("counts, fraction, expected", [
    ([50_000, 50_000], 0.2, 20_000), ([1_000_000], 0.2, 200_000), ([7], 0.5, 4),
    ([50_000, None], 0.2, None), ([], 0.2, None),
])
def test_placement_holdout_rows_from_the_window(counts, fraction, expected):
    assert holdout_rows(counts, fraction) == expected


EVALUATION = EvaluationPlacementConfig(max_cpu_s=30.0, cpu_parameter_rows_per_s=5.5e10,
                                       gpu_parameter_rows_per_s=2.26e13, measured="test figures")
SMALL, LARGE = 12_417, 27_402_241


@pytest.mark.parametrize("challenger, champion, rows, device, config, side, rule, fragments", [
    (SMALL, SMALL, 200_000, "auto", EVALUATION, "cpu", "cpu-fast",
     ["challenger 12.4k + champion 12.4k parameters x 200k holdout rows = 5e9 parameter-rows", "<= max_cpu_s 30"]),
    (LARGE, SMALL, 200_000, "auto", EVALUATION, "gpu", "cpu-slow",
     ["= 5.5e12 parameter-rows: ~100 s on CPU at 5.5e10/s, ~0.24 s on a GPU (> max_cpu_s 30)",
      "-> gpu-training partition"]),
    (LARGE, LARGE, 200_000, "gpu", EVALUATION, "gpu", "cpu-slow", ["~199 s on CPU"]),
    (LARGE, LARGE, 200_000, "cpu", EVALUATION, "cpu", "requested", ["device=cpu requested"]),
    (LARGE, 0, 40_000, "auto", EVALUATION, "cpu", "cpu-fast", ["(no champion)", "~20 s on CPU"]),
    (LARGE, None, 80_000, "auto", EVALUATION, "gpu", "cpu-slow", ["the champion's size is not recorded"]),
    (LARGE, SMALL, None, "auto", EVALUATION, "cpu", "not-measured", ["holdout rows not measured"]),
    (LARGE, SMALL, 200_000, "auto", EvaluationPlacementConfig(), "cpu", "not-measured",
     ["CPU scoring rate not measured", "the CPU partition, the default"]),
], ids=["small-pair", "large-vs-small", "large-pair-gpu-asked", "large-pair-cpu-asked", "first-model",
        "champion-size-unknown", "rows-unknown", "rate-unknown"])
def test_placement_evaluation_rule(challenger, champion, rows, device, config, side, rule, fragments):
    decided = evaluation_placement(challenger, champion, rows, config=config, cpu_partition="cpu",
                                   gpu_partition="gpu-training", device=device)
    assert (decided.side, decided.rule) == (side, rule), decided.reason
    assert (decided.partition, decided.gpus_per_node) == (("gpu-training", 1) if side == "gpu" else ("cpu", 0))
    for fragment in fragments:
        assert fragment in decided.reason, decided.reason


@pytest.mark.parametrize("rows_per_s, usd_per_hour, expected", [
    (40_000, 4.1, 4.1 / 144_000), (14_100, 0.1, 0.1 / 50_760), (None, 4.1, None),
])
def test_placement_usd_per_1k_rows(rows_per_s, usd_per_hour, expected):
    got = usd_per_1k_rows(rows_per_s, usd_per_hour)
    assert got == expected or math.isclose(got, expected)


@pytest.mark.parametrize("value, text", [
    (1.58e-6, "$0.0000016"), (2.847e-5, "$0.000028"), (0.028, "$0.028"), (12.0, "$12"), (0.0, "$0")])
def test_placement_usd_text_has_two_significant_digits_and_no_exponent(value, text):
    assert usd_text(value) == text


@pytest.mark.parametrize("value, text", [
    (17_600, "17.6k rows/s"), (40_000, "40k rows/s"), (490_000, "490k rows/s"), (1_200_000, "1.2M rows/s"),
    (376, "376 rows/s")])
def test_placement_rows_text(value, text):
    assert rows_text(value) == text
