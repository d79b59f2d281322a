"""Benchmark `training`: DeepSpeed engine steps/s against a plain torch loop, same model, data and optimizer.

The DeepSpeed side is what jobs/train.py runs: ``include/deepspeed/zero1.json`` (ZeRO-1, torch AdamW, gradient
clipping 1.0), one process (gloo on CPU, NCCL on a GPU). The torch side is ``torch.optim.AdamW`` with the same
hyperparameters and ``clip_grad_norm_``. Both start from the same weights and take the same batches of the
same synthetic rows. Timing alternates short windows of each loop and reports the median of each, so load from
other processes on a shared machine hits both alike.

Prints ``RESULT training deepspeed_steps_per_s=<x> torch_steps_per_s=<y> deepspeed_rows_per_s=<r>
gpu_mean_util_pct=<u>``; ``main()`` returns the figures. Rows are this tabular model's tokens. On a GPU machine
(CUDA torch, nvidia-smi on PATH) the same command measures the GPU: NCCL, one GPU, and nvidia-smi sampled every
second while the loops run; without one, utilization is "not measured", never invented.
Environment: BENCH_TRAINING_PRESET (default small), BENCH_TRAINING_BATCH (256), BENCH_TRAINING_STEPS (steps
per window, 60), BENCH_TRAINING_ROUNDS (15), BENCH_TRAINING_THREADS (torch threads, 1: on a shared 2-core
machine a second intra-op thread made both loops several times slower and noisier), BENCH_TRAINING_ZERO_STAGE
(1; the stage applied to ``zero1.json``, as the run config's zero_stage does).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "jobs"))

from hybridtrain.config import DEFAULT_MODEL_PRESETS_PATH, deepspeed_settings_for_run, load_model_presets  # noqa: E402
from hybridtrain.engine import init_engine  # noqa: E402
from hybridtrain.gpu import GpuSampler, read_gpu_metrics, summarise_gpu_metrics  # noqa: E402
from hybridtrain.launch import distributed_environment, free_port  # noqa: E402
from hybridtrain.model import build_network, count_parameters  # noqa: E402

N_FEATURES = 32
N_ROWS = 65_536
WARMUP_STEPS = 10
SEED = 0


def _setting(name: str, default: int | str) -> int | str:
    value = os.environ.get(f"BENCH_TRAINING_{name}")
    if value is None:
        return default
    return type(default)(value)


def _synthetic_rows() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    features = rng.normal(size=(N_ROWS, N_FEATURES)).astype(np.float32)
    logit = features[:, :4] @ np.array([1.5, -1.0, 0.8, 0.5], dtype=np.float32)
    labels = (rng.random(N_ROWS) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return features, labels


class _Batches:
    """The same sequence of batches for either loop."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, batch: int, device: torch.device) -> None:
        order = np.random.default_rng(SEED).permutation(len(labels))
        self._x = torch.from_numpy(features[order]).to(device)
        self._y = torch.from_numpy(labels[order]).to(device)
        self._batch = batch
        self._per_epoch = len(labels) // batch

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step % self._per_epoch) * self._batch
        return self._x[start : start + self._batch], self._y[start : start + self._batch]


def _loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(model(inputs).squeeze(1), labels)


def _deepspeed_window(engine, batches: _Batches, first: int, steps: int, device: torch.device) -> float:
    started = time.perf_counter()
    for step in range(first, first + steps):
        inputs, labels = batches(step)
        loss = _loss(engine, inputs, labels)
        engine.backward(loss)
        engine.step()
    _synchronize(device)
    return steps / (time.perf_counter() - started)


def _torch_window(model, optimizer, batches: _Batches, first: int, steps: int, device: torch.device) -> float:
    started = time.perf_counter()
    for step in range(first, first + steps):
        inputs, labels = batches(step)
        loss = _loss(model, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    _synchronize(device)
    return steps / (time.perf_counter() - started)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> dict:
    preset_name = str(_setting("PRESET", "small"))
    batch = int(_setting("BATCH", 256))
    steps = int(_setting("STEPS", 60))
    rounds = int(_setting("ROUNDS", 15))
    zero_stage = int(_setting("ZERO_STAGE", 1))
    torch.set_num_threads(int(_setting("THREADS", 1)))
    os.environ.update(distributed_environment(os.environ, free_port))

    spec = load_model_presets(DEFAULT_MODEL_PRESETS_PATH)[preset_name]
    settings = json.loads((REPO / "include" / "deepspeed" / "zero1.json").read_text())
    ds_config, _ = deepspeed_settings_for_run(
        settings, batch_size=batch, world_size=1, learning_rate=1e-3, zero_stage=zero_stage
    )
    torch.manual_seed(SEED)
    network = build_network(N_FEATURES, spec)
    reference = copy.deepcopy(network)
    engine, device = init_engine(network, ds_config, int(os.environ["LOCAL_RANK"]))
    reference.to(device).train()
    params = ds_config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(
        reference.parameters(),
        lr=params["lr"],
        betas=tuple(params["betas"]),
        eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    batches = _Batches(*_synthetic_rows(), batch, device)
    engine.train()

    _deepspeed_window(engine, batches, 0, WARMUP_STEPS, device)
    _torch_window(reference, optimizer, batches, 0, WARMUP_STEPS, device)
    deepspeed_rates, torch_rates = [], []
    samples_path = Path(tempfile.mkdtemp(prefix="bench-training-")) / "gpu_metrics.jsonl"
    sampler = GpuSampler(samples_path, interval_s=1.0)
    sampler.start()
    try:
        for index in range(rounds):
            first = WARMUP_STEPS + index * steps
            deepspeed_rates.append(_deepspeed_window(engine, batches, first, steps, device))
            torch_rates.append(_torch_window(reference, optimizer, batches, first, steps, device))
    finally:
        sampler.stop()
    gpu = summarise_gpu_metrics(read_gpu_metrics(samples_path))

    deepspeed_rate = statistics.median(deepspeed_rates)
    torch_rate = statistics.median(torch_rates)
    result = {
        "deepspeed_steps_per_s": round(deepspeed_rate, 2),
        "torch_steps_per_s": round(torch_rate, 2),
        "deepspeed_overhead_pct": round(100 * (torch_rate / deepspeed_rate - 1), 1),
        "deepspeed_samples_per_s": round(deepspeed_rate * batch, 1),
        "torch_samples_per_s": round(torch_rate * batch, 1),
        "deepspeed_rounds": [round(rate, 2) for rate in deepspeed_rates],
        "torch_rounds": [round(rate, 2) for rate in torch_rates],
        "preset": preset_name,
        "n_parameters": count_parameters(reference),
        "batch_size": batch,
        "steps_per_round": steps,
        "rounds": rounds,
        "zero_stage": zero_stage,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
    }
    utilization = gpu.get("mean_utilization_pct")
    print(
        f"RESULT training deepspeed_steps_per_s={result['deepspeed_steps_per_s']} "
        f"torch_steps_per_s={result['torch_steps_per_s']} "
        f"deepspeed_rows_per_s={result['deepspeed_samples_per_s']} "
        f"gpu_mean_util_pct={utilization if utilization is not None else 'not_measured'}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
