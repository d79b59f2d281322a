"""DeepSpeed set-up on GPUs, without a GPU: which device each rank takes, and the collective timeout everywhere.

torch and DeepSpeed are replaced at their entry points (this machine has no CUDA): the test checks what the job
asks of them, which is where Slurm's one-GPU-per-task binding would otherwise fail on local rank 1.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import deepspeed
import pytest
import torch
import torch.distributed as dist
from hybridtrain import engine as ds_engine


@pytest.fixture
def fake_cuda(monkeypatch):
    """Record what init_engine asks of CUDA, torch.distributed and DeepSpeed."""
    calls: dict[str, object] = {}
    monkeypatch.setattr(dist, "new_group", dist.new_group)  # restored after init_engine wraps it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.__setitem__("set_device", index))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kwargs: calls.__setitem__("init_process_group", (backend, kwargs))
    )
    monkeypatch.setattr(
        deepspeed, "init_distributed", lambda **kwargs: calls.__setitem__("init_distributed", kwargs)
    )

    def initialize(**kwargs):
        calls["initialize"] = kwargs
        return "engine", None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)

    def start(local_rank: int, device_count: int, world_size: int) -> dict[str, object]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        engine, device = ds_engine.init_engine(torch.nn.Linear(2, 1), {}, local_rank, timeout_s=42)
        calls["engine"], calls["device"] = engine, device
        return calls

    return start


@pytest.mark.parametrize(
    ("local_rank", "device_count", "world_size", "index"),
    [
        (1, 1, 2, 0),
        (3, 1, 8, 0),
        (1, 4, 4, 1),
        (0, 1, 1, 0),
        (2, 1, 1, 0),
    ],
    ids=[
        "slurm-one-gpu-per-task-local-rank-1",
        "slurm-one-gpu-per-task-local-rank-3",
        "every-gpu-visible",
        "single-rank",
        "single-rank-local-rank-2",
    ],
)
def test_training_init_engine_binds_nccl_and_deepspeed_to_the_bound_gpu(
    fake_cuda, local_rank, device_count, world_size, index
):
    calls = fake_cuda(local_rank, device_count, world_size)
    assert calls["set_device"] == index
    assert calls["device"] == torch.device("cuda", index)
    backend, kwargs = calls["init_process_group"]
    assert backend == "nccl" and kwargs["timeout"] == timedelta(seconds=42)
    # a single rank too: without device_id NCCL guesses the device from the global rank and warns each run
    assert kwargs.get("device_id") == torch.device("cuda", index)
    assert calls["init_distributed"] == {"dist_backend": "nccl", "timeout": timedelta(seconds=42)}
    assert calls["initialize"]["args"] == SimpleNamespace(device_rank=index), "not DeepSpeed's cuda:LOCAL_RANK"


@pytest.mark.parametrize(
    ("args", "kwargs", "timeout"),
    [
        ((), {"ranks": [0, 1]}, timedelta(seconds=42)),
        (([0, 1],), {}, timedelta(seconds=42)),
        (([0, 1],), {"timeout": None}, timedelta(seconds=42)),
        (([0, 1],), {"timeout": timedelta(seconds=7)}, timedelta(seconds=7)),
        (([0, 1], timedelta(seconds=9)), {}, timedelta(seconds=9)),
    ],
    ids=["keyword-ranks", "positional-ranks", "explicit-none", "explicit-timeout-kept", "positional-timeout-kept"],
)
def test_training_process_groups_default_to_the_collective_timeout(monkeypatch, args, kwargs, timeout):
    """DeepSpeed's clone of the world group (its gradient reductions) is created without a timeout."""
    created = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: created.append((a, k)) or "group")
    ds_engine._groups_default_to(timedelta(seconds=42))
    ds_engine._groups_default_to(timedelta(seconds=42))  # a second engine in one process does not stack wrappers
    assert dist.new_group(*args, **kwargs) == "group"
    ((passed_args, passed_kwargs),) = created
    assert (passed_kwargs.get("timeout") or passed_args[1]) == timeout


def test_training_clips_gradients_before_the_optimizer_step_without_reading_the_norm():
    """Stage 0's hook: the whole gradients to a global norm of max_norm, on the device (nothing read on the host);
    a norm within the bound is left alone. (ZeRO 1/2 partitions: test_train_host_syncs compares the stages.)"""
    from helpers.host_syncs import HostSyncCounter

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)  # lr 0: the step leaves the clipped gradients to read
    ds_engine.clip_gradients_before_step(SimpleNamespace(zero_optimization_stage=lambda: 0, optimizer=optimizer), 0.5)
    for fill, norm in ((2.0, 0.5), (0.01, 0.01 * 8**0.5)):  # 8 gradient values
        for parameter in layer.parameters():
            parameter.grad = torch.full_like(parameter, fill)
        with HostSyncCounter() as syncs:
            optimizer.step()
        assert syncs.total == 0, syncs.calls
        assert float(torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()])) == pytest.approx(norm, 1e-5)
        assert torch.allclose(layer.weight.grad, layer.weight.grad[0, 0].expand_as(layer.weight)), "direction kept"


def test_training_clipping_before_the_step_needs_one_parameter_group():
    first, second = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1)
    with pytest.raises(ValueError, match="one parameter group, not 2"):
        ds_engine.clip_gradients_before_step(SimpleNamespace(zero_optimization_stage=lambda: 0, optimizer=optimizer), 1)
