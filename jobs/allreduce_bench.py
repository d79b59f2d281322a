"""All-reduce preflight: is the interconnect fast enough for data-parallel training of this model?

Measures torch.distributed all_reduce over gradient-sized buffers (NCCL on GPUs, gloo on CPUs), the compute
time of one training step of the model, and the share of a step that all-reducing its gradients would take.
Writes one JSON result; the training DAG refuses to start when the share is over the threshold.

    python jobs/allreduce_bench.py --out result.json [--procs 2] [--hidden-sizes 128,64] [--features 64]

Inside an ``srun`` step of several tasks the world comes from Slurm (one rank per task, across nodes; the
address and port from ``hybridtrain.launch``, as the training job derives them), so the preflight measures the
same topology as the training it gates; the result records it (nodes x ranks per node). On one machine without
that, ``--procs N`` spawns N local processes. Never imports Airflow.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import UTC, datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hybridjobs.atomic import write_json_atomic
from hybridtrain.launch import cuda_device_index, distributed_environment, free_port, node_name
from torch import nn

BUCKET_SIZES_MB = (1, 4, 16, 64)


def mlp(features: int, hidden: list[int]) -> nn.Module:
    layers, width = [], features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, 1))


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() over repeats, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bus_bandwidth_gbps(nbytes: int, seconds: float, world: int) -> float:
    """NCCL-tests' bus bandwidth for all-reduce: algorithm bandwidth x 2(n-1)/n."""
    return nbytes / seconds * 2 * (world - 1) / world / 1e9 if seconds > 0 else 0.0


def topology(nodes_of_ranks: list[str]) -> dict:
    """Nodes x ranks per node from each rank's node name (rank order)."""
    nodes = sorted(set(nodes_of_ranks))
    per_node = {node: nodes_of_ranks.count(node) for node in nodes}
    ranks_per_node = max(per_node.values())
    return {"nodes": len(nodes), "ranks_per_node": ranks_per_node, "world_size": len(nodes_of_ranks),
            "uniform": len(set(per_node.values())) == 1, "node_names": nodes}


def measure(rank: int, world: int, args: argparse.Namespace, local_rank: int = 0) -> dict | None:
    use_cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    torch.set_num_threads(cpus or max(1, (os.cpu_count() or 1) // world))
    # bound to the rank's GPU: NCCL otherwise guesses it from the global rank (and warns)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                            **({"device_id": device} if use_cuda else {}))
    try:
        names: list[str] = [""] * world
        dist.all_gather_object(names, node_name(os.environ, socket.gethostname()))
        sizes = []
        for mb in BUCKET_SIZES_MB:
            buf = torch.ones(mb * (1 << 20) // 4, device=device)
            seconds = timed(lambda buf=buf: dist.all_reduce(buf), args.repeats, device)
            sizes.append({"bytes": buf.numel() * 4, "seconds": seconds,
                          "busbw_gbps": bus_bandwidth_gbps(buf.numel() * 4, seconds, world)})

        model = mlp(args.features, args.hidden_sizes).to(device)
        batch = torch.randn(args.batch, args.features, device=device)
        target = torch.rand(args.batch, 1, device=device)
        loss_fn = nn.BCEWithLogitsLoss()

        def compute_step():
            model.zero_grad(set_to_none=True)
            loss_fn(model(batch), target).backward()

        compute_s = timed(compute_step, args.repeats, device)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        allreduce_s = timed(lambda: dist.all_reduce(grads), args.repeats, device)
        # Every rank measured; the slowest rank sets the pace of a synchronous step.
        figures = torch.tensor([compute_s, allreduce_s], dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        compute_s, allreduce_s = figures.tolist()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    share = allreduce_s / (compute_s + allreduce_s)
    return {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "backend": "nccl" if use_cuda else "gloo",
        "world_size": world,
        "topology": topology(names),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "sizes": sizes,
        "busbw_gbps_at_largest": sizes[-1]["busbw_gbps"],
        "model": {"features": args.features, "hidden_sizes": args.hidden_sizes, "batch": args.batch,
                  "gradient_bytes": grads.numel() * 4},
        "compute_step_s": compute_s,
        "allreduce_s": allreduce_s,
        "allreduce_share": share,
    }


def worker(rank: int, world: int, args: argparse.Namespace, local_rank: int | None = None) -> None:
    result = measure(rank, world, args, rank if local_rank is None else local_rank)
    if result is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json_atomic(args.out, result)  # readers never see half a result
        print(f"ALLREDUCE world={world} backend={result['backend']} busbw={result['busbw_gbps_at_largest']:.2f}GB/s "
              f"share={result['allreduce_share']:.1%}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--procs", type=int, default=2, help="local processes when not launched by Slurm tasks")
    parser.add_argument("--hidden-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.procs < 2 and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) < 2:
        parser.error("an all-reduce over one process measures nothing: run at least 2 ranks (srun tasks, or "
                     "--procs 2 outside Slurm)")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        environment = distributed_environment(os.environ, free_port)
        os.environ.update(environment)
        worker(int(environment["RANK"]), int(environment["WORLD_SIZE"]), args, int(environment["LOCAL_RANK"]))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        mp.spawn(worker, args=(args.procs, args), nprocs=args.procs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
