"""DeepSpeed set-up without JIT builds, and the helpers that need every rank."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "SHM_COMM_OPT_IN",
    "broadcast_from_rank0",
    "full_state_dict",
    "init_engine",
    "input_dtype",
    "max_across_ranks",
    "mean_across_ranks",
    "torch_linear",
]

# ZeRO-3 replaces torch.nn.functional.linear process-wide (zero_optimization.memory_efficient_linear, on by
# default); TorchScript must compile the real one, captured here before any engine exists.
_TORCH_LINEAR = torch.nn.functional.linear

# DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op (g++ and ninja, ~20 s) inside
# init_distributed; a cluster node may have no compiler. Set this variable to 1 to allow the build.
SHM_COMM_OPT_IN = "HYBRIDTRAIN_ENABLE_SHM_COMM"


def init_engine(
    network: nn.Module, ds_config: dict[str, Any], local_rank: int
) -> tuple[deepspeed.DeepSpeedEngine, torch.device]:
    """Start torch.distributed (NCCL on CUDA, gloo on CPU) and wrap ``network`` in a DeepSpeed engine.

    Expects RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment.
    """
    if os.environ.get(SHM_COMM_OPT_IN) != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DeepSpeed 0.19 calls torch.distributed collectives that torch 2.13 deprecates, once per ZeRO step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    deepspeed.init_distributed(dist_backend=backend)
    engine, _, _, _ = deepspeed.initialize(
        model=network, model_parameters=network.parameters(), config=ds_config
    )
    return engine, device


def input_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine's module computes in: bf16 or fp16 when the DeepSpeed config enables them."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def full_state_dict(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """The whole network's float32 weights on CPU, on every rank: the optimizer's fp32 master copy where
    DeepSpeed keeps one (ZeRO, bf16), gathered across ranks under ZeRO-3. Every rank must call it."""
    module = engine.module
    state = {}
    for name, parameter in module.named_parameters():
        full = deepspeed.utils.safe_get_full_fp32_param(parameter)
        state[name] = (parameter.data if full is None else full).detach().float().cpu().clone()
    return state


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (any picklable object)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def mean_across_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over all ranks."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value.item())


def max_across_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of all ranks, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


@contextmanager
def torch_linear() -> Iterator[None]:
    """Run the block with torch's own ``linear`` (for TorchScript export after a ZeRO-3 engine patched it)."""
    current = torch.nn.functional.linear
    torch.nn.functional.linear = _TORCH_LINEAR
    try:
        yield
    finally:
        torch.nn.functional.linear = current
