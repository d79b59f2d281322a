"""DeepSpeed set-up without JIT builds, and the helpers that need every rank."""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from hybridtrain.launch import cuda_device_index
from torch import nn

__all__ = [
    "SHM_COMM_OPT_IN",
    "broadcast_from_rank0",
    "clip_gradients_before_step",
    "control_group",
    "end_process_group",
    "full_state_dict",
    "gather_objects",
    "init_engine",
    "input_dtype",
    "max_across_ranks",
    "max_figures_across_ranks",
    "mean_across_ranks",
    "synchronize",
    "time_all_reduce",
    "torch_linear",
]

# ZeRO-3 replaces torch.nn.functional.linear process-wide (zero_optimization.memory_efficient_linear, on by
# default); TorchScript must compile the real one, captured here before any engine exists.
_TORCH_LINEAR = torch.nn.functional.linear

# DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce op (g++ and ninja, ~20 s) inside
# init_distributed; a cluster node may have no compiler. Set this variable to 1 to allow the build.
SHM_COMM_OPT_IN = "HYBRIDTRAIN_ENABLE_SHM_COMM"


def init_engine(
    network: nn.Module, ds_config: dict[str, Any], local_rank: int, *, timeout_s: float = 300.0
) -> tuple[deepspeed.DeepSpeedEngine, torch.device]:
    """Start torch.distributed (NCCL on CUDA, gloo on CPU) and wrap ``network`` in a DeepSpeed engine.

    Expects RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment.

    :param local_rank: this process's rank on its node; the GPU is :func:`cuda_device_index` of it. DeepSpeed
        0.19.8 would take ``cuda:LOCAL_RANK`` in two places (the NCCL group's ``device_id`` in
        ``comm/torch.py`` and ``set_device`` in the engine), which does not exist on local rank 1 when Slurm
        binds one GPU per task; so torch.distributed is started here, and the engine gets the index as
        ``args.device_rank``.
    :param timeout_s: how long the rendezvous and any collective may wait for the other ranks before this
        process fails (``collective_timeout_s``): a dead or stuck peer ends the job instead of hanging it
        until Slurm's time limit. It must exceed the longest pause of one rank alone (rank 0 verifying a
        checkpoint at resume, hashing one for its manifest).
    """
    if os.environ.get(SHM_COMM_OPT_IN) != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    args = None
    if torch.cuda.is_available():
        index = cuda_device_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device, backend = torch.device("cuda", index), "nccl"
        args = SimpleNamespace(device_rank=index)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DeepSpeed 0.19 calls torch.distributed collectives that torch 2.13 deprecates, once per ZeRO step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    timeout = timedelta(seconds=timeout_s)
    _groups_default_to(timeout)
    if not dist.is_initialized():
        # Bound to this rank's GPU, a single rank too: NCCL otherwise guesses the device from the global rank
        # (and says so on every run).
        bind = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **bind)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=network, model_parameters=network.parameters(), config=ds_config
    )
    return engine, device


def _groups_default_to(timeout: timedelta) -> None:
    """Make process groups created without a timeout use ``timeout`` instead of torch's backend default.

    ``init_distributed(timeout=...)`` sets only the default group's timeout. DeepSpeed 0.19.8 runs its gradient
    reductions on a clone of the world group (``utils/groups.py: _clone_world_group`` calls ``new_group``
    without a timeout), which torch gives its backend default (30 min for gloo, 10 min for NCCL): measured here,
    a frozen peer then held the other rank in ZeRO's gradient-norm all-reduce for over a minute with a 4 s
    ``collective_timeout_s``. DeepSpeed calls ``torch.distributed.new_group`` by attribute, so wrapping it
    before ``deepspeed.initialize`` covers its groups.
    """
    original = getattr(dist.new_group, "__wrapped__", dist.new_group)

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("timeout") is None:
            kwargs["timeout"] = timeout
        return original(*args, **kwargs)

    dist.new_group = new_group


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


def control_group(device: torch.device) -> Any:
    """The process group for the loop's host-side agreements (stop requests): None (the default group, gloo) on
    CPUs or a single rank, a gloo group beside NCCL on GPUs. Reading back an NCCL all-reduce waits for every kernel
    queued before it, so agreeing on a stop through NCCL each step would drain the GPU's queue each step. Every
    rank must call it, in the same order as its other group creations."""
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def max_across_ranks(value: int, group: Any = None) -> int:
    """The largest ``value`` of all ranks, on every rank, through ``group`` (a CPU group: see control_group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def end_process_group(device: torch.device) -> None:
    """Tear torch.distributed down at the end of a successful job: on GPUs, where NCCL would warn of a leak
    otherwise, and for a single rank, so that a later training in the same process starts a group of its own.

    Through DeepSpeed's comm layer, which also drops the groups DeepSpeed caches (its clone of the world group):
    torch's own ``destroy_process_group`` left them stale, and the next ``deepspeed.initialize`` in the process
    failed with "Group ... is not registered". Several gloo (CPU) ranks are left to the process exit: destroying
    them while a peer was still finishing aborted that rank in CI ("terminate called without an active
    exception", srun then killed the step). On GPUs every rank first waits for the others, so none tears its
    communicators down under a peer's last collective."""
    if not dist.is_initialized() or (device.type != "cuda" and dist.get_world_size() > 1):
        return
    dist.barrier()
    deepspeed.comm.destroy_process_group()


def clip_gradients_before_step(engine: deepspeed.DeepSpeedEngine, max_norm: float) -> None:
    """Clip the gradients to a global L2 norm of ``max_norm`` on the device, right before each optimizer step.

    DeepSpeed 0.19.8's own clipping reads the norm on the host, which waits for the GPU's queue every step: at
    stage 0 it builds two tensors from host values, under ZeRO 1/2 ``is_invalid_grad_norm`` calls ``bool()`` on
    it (``settings_for_device`` turns DeepSpeed's off). A pre-hook on the optimizer that applies the step sees
    the gradients at their final state: at stage 0 the whole gradients, already averaged over the ranks; under
    ZeRO 1/2 this rank's fp32 partition of them, so the squared norms are summed over the ranks first.
    """
    partitioned = engine.zero_optimization_stage() in (1, 2)
    optimizer = engine.optimizer.optimizer if partitioned else engine.optimizer
    if len(optimizer.param_groups) != 1:
        # ZeRO steps one parameter group at a time: a norm per group would not be the global one.
        raise ValueError(f"clipping before the step needs one parameter group, not {len(optimizer.param_groups)}")
    dp_group = engine.optimizer.dp_process_group if partitioned else None

    def clip(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
        if partitioned and dist.get_world_size(dp_group) > 1:
            squares = norm.square()
            dist.all_reduce(squares, group=dp_group)
            norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)

    optimizer.register_step_pre_hook(clip)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a clock read after it means done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(buffer: torch.Tensor, device: torch.device) -> float:
    """Seconds of one ``dist.all_reduce`` of ``buffer`` on the default process group, every rank together.

    A barrier first lines the ranks up, so the time is the all-reduce's and not the wait for a late rank.
    """
    dist.barrier()
    synchronize(device)
    started = time.perf_counter()
    dist.all_reduce(buffer)
    synchronize(device)
    return time.perf_counter() - started


def max_figures_across_ranks(figures: list[float], device: torch.device) -> list[float]:
    """The element-wise largest of every rank's ``figures`` (same length everywhere), on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(figures)
    tensor = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


@contextmanager
def torch_linear() -> Iterator[None]:
    """Run the block with torch's own ``linear`` (for TorchScript export after a ZeRO-3 engine patched it)."""
    current = torch.nn.functional.linear
    torch.nn.functional.linear = _TORCH_LINEAR
    try:
        yield
    finally:
        torch.nn.functional.linear = current
