"""The training loop makes the host wait for the GPU at most once per ``log_every_steps`` (the loss it reads),
DeepSpeed's step included, for each precision and ZeRO stage a run config can choose; counted on the CPU over 100
steps by torch's own hooks (``helpers.host_syncs``), one rank for stage 0 and two ranks for every stage.

Each run uses the optimizer a GPU gets (``settings_for_device`` fuses torch's AdamW on CUDA; the unfused one keeps
its step counts on the host, which is free there). The all-reduce share's sampled steps synchronize on purpose
(they time one step) and stay out of these 100 steps. Not covered: DeepSpeed's bf16 weights at stage 0, whose
optimizer reads the gradients' overflow and norms on the host seven times a step (bf16 autocast over float32
weights is the stage-0 bf16 path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.feature_partitions import write_features
from helpers.host_syncs import HostSyncCounter
from hybridtrain.launch import free_port

REPO = Path(__file__).resolve().parents[4]
STEPS, LOG_EVERY, FIRST, CLIP = 100, 10, 10, 0.01
ONE_RANK = [(0, "fp32", "zero0.json"), (0, "bf16", "zero0.json")]
TWO_RANKS = [(0, "bf16", "zero0.json"), (1, "fp32", "zero1.json"), (1, "bf16", "zero1.json"),
             (2, "fp32", "zero2.json"), (2, "bf16", "zero2.json"), (2, "auto", "zero2_bf16.json")]


def case_id(case: tuple[int, str, str]) -> str:
    stage, precision, file = case
    return f"zero{stage}-{precision}-{file.removesuffix('.json')}"


def write_case(directory: Path, features: Path, ranks: int, case: tuple[int, str, str]) -> list[str]:
    stage, precision, file = case
    settings = json.loads((REPO / "include" / "deepspeed" / file).read_text())
    settings["optimizer"]["params"]["fused"] = True
    settings["gradient_clipping"] = CLIP  # always below the gradients' norm: every step clips
    deepspeed_config = directory / f"{case_id(case)}.ds.json"
    deepspeed_config.write_text(json.dumps(settings))
    paths = []
    for steps in (FIRST, FIRST + STEPS):
        run_id = f"{case_id(case)}-ranks{ranks}" + ("" if steps > FIRST else "-short")
        path = directory / f"{run_id}.json"
        path.write_text(json.dumps({
            "run_id": run_id, "features_root": str(features), "ds": ["2026-01-01"], "run_dir": str(directory / run_id),
            "model": {"preset": "tiny"}, "max_steps": steps, "batch_size": 16, "learning_rate": 0.01,
            "checkpoint_every_steps": 1000, "seed": 7, "zero_stage": stage, "precision": precision,
            "deepspeed_config": str(deepspeed_config), "log_every_steps": LOG_EVERY,
            "allreduce_sample_every_steps": 1000, "torch_threads": 1,
        }))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("host-syncs")


@pytest.fixture(scope="module")
def counted(directory) -> dict[str, list[dict]]:
    """Every case's counts per rank: one process for one rank, torchrun for two (the two launches side by side)."""
    write_features(directory / "features", "2026-01-01", seed=0, customers=4000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "jobs"), str(REPO / "tests")])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launches = []
    for ranks, cases in ((1, ONE_RANK), (2, TWO_RANKS)):
        configs = [path for case in cases for path in write_case(directory, directory / "features", ranks, case)]
        launcher = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
        launches.append(subprocess.Popen([*launcher, "-m", "helpers.host_sync_job", *configs], env=env, cwd=directory,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for launch in launches:
        output, _ = launch.communicate(timeout=600)
        assert launch.returncode == 0, output[-4000:]
    results: dict[str, list[dict]] = {}
    for path in sorted(directory.glob("hostsyncs-*.json")):  # one per case and rank (helpers/host_sync_job.py)
        record = json.loads(path.read_text())
        results.setdefault(record["config"], []).append(record)
    return results


@pytest.mark.parametrize(("ranks", "case"), [(1, case) for case in ONE_RANK] + [(2, case) for case in TWO_RANKS],
                         ids=[f"{ranks}rank-{case_id(case)}" for ranks, case in
                              [(1, case) for case in ONE_RANK] + [(2, case) for case in TWO_RANKS]])
def test_training_loop_waits_for_the_gpu_at_most_once_per_logged_step(counted, ranks, case):
    records = counted.get(f"{case_id(case)}-ranks{ranks}", [])
    assert sorted(record["rank"] for record in records) == list(range(ranks))
    for record in records:
        total = sum(n for _, _, n in record["calls"])
        assert total <= STEPS // LOG_EVERY, f"rank {record['rank']}: {total} syncs in {STEPS} steps: {record['calls']}"
        # the count sees the loop: the loss read of every logged step is there
        assert [site for _, site, n in record["calls"] if "mean_across_ranks" in site and n == STEPS // LOG_EVERY]


@pytest.mark.parametrize("cases", [
    [(0, "bf16", "zero0.json"), (1, "bf16", "zero1.json"), (2, "bf16", "zero2.json")],
    [(1, "fp32", "zero1.json"), (2, "fp32", "zero2.json")],
], ids=["bf16-autocast", "fp32"])
def test_training_clips_the_global_norm_under_every_stage(counted, directory, cases):
    """Clipping before the step sees whole gradients at stage 0 and one rank's partition under ZeRO 1/2: with the
    partitions' norms summed over the ranks, every stage takes the same steps (a rank's own norm would not)."""
    curves = [json.loads((directory / f"{case_id(case)}-ranks2" / "metrics.json").read_text())["loss_curve"]
              for case in cases]
    assert len(curves[0]) == STEPS // LOG_EVERY + 1
    for curve in curves[1:]:
        assert [point["step"] for point in curve] == [point["step"] for point in curves[0]]
        assert [point["loss"] for point in curve] == pytest.approx([point["loss"] for point in curves[0]], abs=1e-5)


@pytest.mark.parametrize(("call", "counted_as"), [
    (lambda t, h: t.sum().item(), "item"),
    (lambda t, h: bool(t.any()), "__bool__"),
    (lambda t, h: float(t[0]), "__float__"),
    (lambda t, h: t.tolist(), "tolist"),
    (lambda t, h: t.cpu(), "cpu"),
    (lambda t, h: t.nonzero(), "aten.nonzero"),
    (lambda t, h: torch.tensor([1.0], device=t.device), "tensor(device=...)"),
    (lambda t, h: h.to(t.device), "to(device) from the host"),
    (lambda t, h: torch.from_numpy(h.numpy()).to(t.device), "to(device) from the host"),
])
def test_host_sync_counter_counts_what_would_wait_for_a_gpu(call, counted_as):
    device_tensor, host_values = torch.arange(4.0), [1.0, 2.0]
    with HostSyncCounter() as syncs:
        call(device_tensor * 1, torch.tensor(host_values))
    assert [kind for kind, _ in syncs.calls] == [counted_as] and syncs.total == 1


def test_host_sync_counter_ignores_host_tensors_and_asynchronous_copies():
    with HostSyncCounter() as syncs:
        flag = torch.tensor([3])  # a host tensor, as the stop agreement over a CPU group makes it
        assert flag.item() == 3
        on_device = torch.from_numpy(np.arange(3)).to("cpu", non_blocking=True)  # from pinned memory on a GPU
        assert (on_device * 2).sum().dtype == torch.int64 and torch.zeros(3, device="cpu").add_(1).shape == (3,)
    assert syncs.total == 0, syncs.calls
