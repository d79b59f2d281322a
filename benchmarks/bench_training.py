"""Benchmark `training`: the real training job on the real local Slurm at 1 and 2 ranks, and the DeepSpeed
engine against a plain torch loop in this process.

**On Slurm** (the figures a pipeline run gets): synthetic features as the Spark job publishes them (default 2
days x 20,000 customers, the 4 feature columns of tests/integration/conftest.py, a planted signal) are written
to ``<storage root>/features/bench-<tag>`` readable by the job user; then ``jobs/train.py`` is submitted
twice through hybridflow's own code path (``DeepSpeedTrainingOperator(...).build_spec`` ->
``render_sbatch_script`` -> ``SlurmHook.submit`` over SSH as the job user, partition gpu-training), one job
after the other: 1 node x 1 rank, then 1 node x 2 ranks (``gpus_per_node=2``, one srun rank per GPU). Both
runs use the same preset, per-rank micro-batch, fixed ``max_steps``, ``torch_threads`` and one CPU per task;
checkpoints only at the last step. ``ranks_<n>_rows_per_s`` is the job's own ``metrics.json`` ``samples_per_s``
(rows all ranks processed / training-loop wall time, start-up excluded); ``scaling_efficiency`` is
``ranks_2 / (2 x ranks_1)``; ``allreduce_share_in_job`` is the 2-rank job's ``metrics["allreduce"]["share"]``
(median time of one all-reduce of the gradient volume, taken after a barrier every 25 steps, over the median
step time; the job measures it), ``not_measured`` when the deployed job does not write it. Per run the result
also keeps the job's wall times (submit to end, queue wait, Slurm elapsed, process), world size, ranks and
nodes, and the job's own GPU summary (``metrics["gpu"]``, per GPU where the job reports it). The features and
both run directories are removed afterwards (the run directories as the job user, who owns them). At 5000 steps
the training loop took 16 s at 1 rank and 60 s at 2 ranks here (2026-12, others' tests running alongside).

**Tracking overhead** (issue 22: at most 2% slower): ``BENCH_TRAINING_TRACKING_PAIRS`` (3) pairs of 1-rank jobs of
the same shape, one without and one with live MLflow tracking (a run on the stack's real server in experiment
``bench-tracking-overhead``, the credentials file and ``tracking`` section the operator writes, rank 0 logging
loss and rows/s every ``log_every_steps`` in batches every 5 s), alternating so that drift in the machine's load
hits both; ``tracking_overhead`` is median(tracked rows/s) / median(untracked rows/s) (1.0: no cost).

What the scaling figure means HERE: this machine has 2 CPU cores shared by everything (the Slurm "GPUs" are
fake GRES). Two ranks are two gloo processes competing for the same 2 cores (with whatever else runs), so the
scaling efficiency is what the cores allow, not what GPUs would give. The all-reduce share does not explain
it: it is taken after a barrier, so it leaves out the time a rank waits for the other to be scheduled, which
is what two processes on two busy cores mostly do. On a GPU machine the same script runs NCCL with one GPU per
rank, and reports per-GPU utilization (nvidia-smi inside the job); without nvidia-smi every GPU figure stays
``not_measured``, never invented.

**In this process** (as before): the DeepSpeed side is what jobs/train.py runs: ``include/deepspeed/
zero1.json`` (ZeRO-1, torch AdamW, gradient clipping 1.0), one process (gloo on CPU, NCCL on a GPU). The torch
side is ``torch.optim.AdamW`` with the same hyperparameters and ``clip_grad_norm_``. Both start from the same
weights and take the same batches of the same synthetic rows (32 features). Timing alternates short windows
of each loop and reports the median of each, so load from other processes on a shared machine hits both
alike. On a GPU machine (CUDA torch, nvidia-smi on PATH) it measures one GPU, nvidia-smi sampled every second.

Prints ``RESULT training ranks_1_rows_per_s=<x> ranks_2_rows_per_s=<y> scaling_efficiency=<y/(2x)>
allreduce_share_in_job=<s> tracking_overhead=<tracked/untracked> deepspeed_steps_per_s=<d> torch_steps_per_s=<t>
deepspeed_rows_per_s=<r> tokens_per_s=<k> mfu=<m> gpu_mean_util_pct=<u>``; ``main()`` returns every figure,
per-GPU utilization among them. Rows are this tabular model's tokens; MFU counts 6 FLOPs per parameter per row
against the GPU's dense bf16 peak (``BENCH_TRAINING_PEAK_TFLOPS`` overrides; "not_measured" on a CPU). Needs the
local stack up (``make up``): the Slurm SSH connection comes from ``.state/airflow-env.json``.

Environment: BENCH_TRAINING_PRESET (default small, both parts), BENCH_TRAINING_THREADS (torch threads, 1,
both parts: on a shared 2-core machine a second intra-op thread made both loops several times slower and
noisier), BENCH_TRAINING_ZERO_STAGE (1, both parts; the stage applied to ``zero1.json``, as the run config's
zero_stage does). In process: BENCH_TRAINING_BATCH (256), BENCH_TRAINING_STEPS (steps per window, 60),
BENCH_TRAINING_ROUNDS (15). On Slurm: BENCH_TRAINING_JOB_STEPS (max_steps of both jobs, 5000),
BENCH_TRAINING_JOB_BATCH (per-rank micro-batch, 256), BENCH_TRAINING_JOB_CUSTOMERS (rows per day, 20000),
BENCH_TRAINING_JOB_DAYS (2), BENCH_TRAINING_JOB_PARTITION (gpu-training), BENCH_TRAINING_JOB_TIMEOUT (seconds
a job may take from submit to end, 600), BENCH_TRAINING_JOB_MASTER_ADDR (unset: the job rendezvous at its first
node's name, as in production; set it to force an address), BENCH_TRAINING_JOB_KEEP (1: keep the features and
run directories, for debugging).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "jobs"))
sys.path.insert(0, str(REPO / "tests"))  # the synthetic feature partitions of the Slurm tests

from helpers.feature_partitions import FEATURES as JOB_FEATURES  # noqa: E402
from helpers.feature_partitions import write_features  # noqa: E402
from hybridflow.layout import CREDENTIALS_FILE, TrainingRunDir  # noqa: E402
from hybridflow.utils.efficiency import describe_time_shares, time_shares  # noqa: E402
from hybridtrain.config import DEFAULT_MODEL_PRESETS_PATH, deepspeed_settings_for_run, load_model_presets  # noqa: E402
from hybridtrain.engine import init_engine  # noqa: E402
from hybridtrain.gpu import GpuSampler, read_gpu_metrics, summarise_gpu_metrics  # noqa: E402
from hybridtrain.launch import distributed_environment, free_port  # noqa: E402
from hybridtrain.model import build_network, count_parameters  # noqa: E402

N_FEATURES = 32
N_ROWS = 65_536
WARMUP_STEPS = 10
SEED = 0

# The Slurm jobs: features as tests/helpers/feature_partitions.py writes them, on the cluster's shared storage.
JOB_FIRST_DAY = date(2026, 1, 1)
JOB_SEED = 7
JOB_RANKS = (1, 2)
NOT_MEASURED = "not_measured"


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


def _in_process(preset_name: str, zero_stage: int) -> dict:
    """The DeepSpeed engine against the plain torch loop, alternating windows in this process."""
    batch = int(_setting("BATCH", 256))
    steps = int(_setting("STEPS", 60))
    rounds = int(_setting("ROUNDS", 15))
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
    n_parameters = count_parameters(reference)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    result = {
        "tokens_per_s": round(deepspeed_rate * batch, 1),
        **_model_flops_utilization(deepspeed_rate * batch, n_parameters, device_name),
        "deepspeed_steps_per_s": round(deepspeed_rate, 2),
        "torch_steps_per_s": round(torch_rate, 2),
        "deepspeed_overhead_pct": round(100 * (torch_rate / deepspeed_rate - 1), 1),
        "deepspeed_samples_per_s": round(deepspeed_rate * batch, 1),
        "torch_samples_per_s": round(torch_rate * batch, 1),
        "deepspeed_rounds": [round(rate, 2) for rate in deepspeed_rates],
        "torch_rounds": [round(rate, 2) for rate in torch_rates],
        "preset": preset_name,
        "n_parameters": n_parameters,
        "batch_size": batch,
        "steps_per_round": steps,
        "rounds": rounds,
        "zero_stage": zero_stage,
        "device": device_name,
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
    }
    return result


# Published dense bf16 peaks (TFLOPS) of the GPUs this suite targets; BENCH_TRAINING_PEAK_TFLOPS overrides.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def _model_flops_utilization(tokens_per_s: float, n_parameters: int, device_name: str) -> dict:
    """MFU: achieved model FLOPs (6 per parameter per training row: 2 forward, 4 backward) over the device's peak;
    "not_measured" with the reason when the peak is unknown (a CPU, an unlisted GPU)."""
    override = os.environ.get("BENCH_TRAINING_PEAK_TFLOPS")
    peak = float(override) if override else next(
        (value for name, value in _PEAK_TFLOPS.items() if name in device_name), None)
    if peak is None:
        return {"mfu": None, "mfu_reason": f"no peak FLOPS known for {device_name} (set BENCH_TRAINING_PEAK_TFLOPS)"}
    achieved = 6 * n_parameters * tokens_per_s
    return {"mfu": round(achieved / (peak * 1e12), 6), "mfu_peak_tflops": peak,
            "mfu_basis": "6 x parameters FLOPs per row over the dense bf16 peak"}


# --- The real training job on the real local Slurm ----------------------------------------------------------


def _stack_environment() -> dict[str, str]:
    """The environment `make up` wrote for Airflow (AIRFLOW_CONN_SLURM_SSH, HYBRIDFLOW_*), set in this process."""
    path = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state")) / "airflow-env.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: the local stack is not up (run `make up`)")
    env = json.loads(path.read_text())
    os.environ.update(env)
    return env


def _write_job_features(root: Path, days: list[str], customers: int) -> None:
    """The Slurm tests' synthetic feature partitions (tests/helpers/feature_partitions.py), readable by the
    job user."""
    for seed, ds in enumerate(days):
        write_features(root, ds, seed, customers)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _share_of(allreduce) -> float | None:
    return allreduce.get("share") if isinstance(allreduce, dict) else None


def _measured(value):
    return NOT_MEASURED if value is None else value


def _placement(ranks) -> str:
    """``0@gpu-node-01, 1@gpu-node-01`` from metrics["deepspeed"]["ranks"]."""
    if not isinstance(ranks, list):
        return str(ranks)
    return ", ".join(f"{entry.get('rank')}@{entry.get('node')}" for entry in ranks)


def _job_log(hook, status) -> str:
    return "".join(hook.read_text(path) or "" for path in (status.stdout_path, status.stderr_path) if path)


def _run_job(hook, stack: dict[str, str], run_config: dict, run_dir: str, *, ranks: int, tag: str,
             partition: str, timeout_s: float, env: dict[str, str], label: str = "") -> dict:
    """Submit jobs/train.py as the operator renders it (1 node x ``ranks`` ranks), wait for the end, read its
    metrics.json; raises unless the job COMPLETED."""
    from hybridflow.operators.training import DeepSpeedTrainingOperator
    from hybridflow.utils.slurm import deterministic_job_name, render_sbatch_script

    op = DeepSpeedTrainingOperator(
        task_id="train", run_config=run_config, run_dir=run_dir, python=stack["HYBRIDFLOW_CLUSTER_PYTHON"],
        jobs_dir=stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"], partition=partition, nodes=1, gpus_per_node=ranks,
        cpus_per_task=1, time_limit=max(5, int(timeout_s // 60) + 1), requeue=False, env=env,
    )
    hook.run(["mkdir", "-p", "--", TrainingRunDir(run_dir).logs])
    hook.write_text(TrainingRunDir(run_dir).config, json.dumps({**op.run_config, "run_dir": run_dir}, indent=2))
    name = deterministic_job_name("bench", "training", f"{tag}-{label or f'ranks{ranks}'}")
    script = render_sbatch_script(op.build_spec(name))
    submitted = time.monotonic()
    job_id = hook.submit(script)
    print(f"training job, 1 node x {ranks} rank(s): Slurm job {job_id} submitted", flush=True)
    started = None
    try:
        status = hook.status(job_id)
        while not (status and status.final(requeue_enabled=False)):
            if started is None and status and status.state == "RUNNING":
                started = time.monotonic()
            if time.monotonic() - submitted > timeout_s:
                raise RuntimeError(f"Slurm job {job_id} ({ranks} ranks) did not end within {timeout_s:.0f} s: {status}")
            time.sleep(1)
            status = hook.status(job_id)
    except BaseException:
        hook.cancel(job_id)
        raise
    ended = time.monotonic()
    if status.state != "COMPLETED":
        raise RuntimeError(f"Slurm job {job_id} ({ranks} ranks) ended {status.state} (exit {status.exit_code}); "
                           f"its log ends:\n{_job_log(hook, status)[-3000:]}")
    metrics = json.loads(hook.read_text(TrainingRunDir(run_dir).metrics) or "{}")
    if not metrics.get("samples_per_s"):
        raise RuntimeError(f"Slurm job {job_id} COMPLETED without samples_per_s in {TrainingRunDir(run_dir).metrics}")
    deepspeed = metrics.get("deepspeed") or {}
    allreduce = metrics.get("allreduce")
    if isinstance(allreduce, dict):
        allreduce = {key: value for key, value in allreduce.items() if key != "series"}  # every sample: long
    gpu = metrics.get("gpu") or {}
    train_wall_s = metrics.get("train_wall_time_s")
    run = {
        "job_id": job_id,
        "state": status.state,
        "ranks_requested": ranks,
        "world_size": deepspeed.get("world_size"),
        "nodes": deepspeed.get("nodes"),
        "ranks": deepspeed.get("ranks", NOT_MEASURED),
        "device": deepspeed.get("device"),
        "alloc_tres": dict(status.alloc_tres),
        "rows_per_s": metrics["samples_per_s"],
        "steps": metrics.get("step"),
        "steps_per_s": round(metrics["step"] / train_wall_s, 2) if metrics.get("step") and train_wall_s else None,
        "rows_processed": metrics.get("train_rows_processed"),
        "train_loop_s": train_wall_s,
        "job_process_wall_s": metrics.get("wall_time_s"),
        "slurm_elapsed_s": status.elapsed_s,
        "submit_to_end_s": round(ended - submitted, 1),
        "queue_wait_s": round(started - submitted, 1) if started is not None else None,
        "holdout_auc": (metrics.get("holdout") or {}).get("auc"),
        "allreduce": _measured(allreduce),
        "gpu_mean_util_pct": _measured(gpu.get("mean_utilization_pct")),
        "gpu_per_device": gpu.get("per_gpu") or NOT_MEASURED,
        "gpu": gpu or NOT_MEASURED,
        # where the job's allocated time went: rank 0's phases over Slurm's elapsed (the rest is "waiting")
        "time_split": time_shares(metrics.get("time_split_s"), status.elapsed_s) or NOT_MEASURED,
    }
    print(f"training job, 1 node x {ranks} rank(s): Slurm job {job_id} {status.state}: {run['rows_per_s']} rows/s, "
          f"{run['steps']} steps in a {train_wall_s} s training loop, world size {run['world_size']}, ranks "
          f"{_placement(run['ranks'])}, {run['submit_to_end_s']} s submit to end (queued {run['queue_wait_s']} s, "
          f"Slurm elapsed {status.elapsed_s} s), all-reduce share {_measured(_share_of(allreduce))}", flush=True)
    split = run["time_split"]
    print(f"  where its {status.elapsed_s} s went: "
          f"{describe_time_shares(split) if isinstance(split, dict) else NOT_MEASURED}", flush=True)
    return run


def _tracking_overhead(hook, stack: dict[str, str], run_config: dict, run_root: str, *, pairs: int,
                       **job) -> dict:
    """1-rank jobs of the same shape, alternating without and with live MLflow tracking (rank 0 logging to the
    stack's real server, as a tracked nightly job does); the median rows/s of each side and their ratio."""
    from hybridflow.hooks.mlflow import MlflowHook

    mlflow = MlflowHook()
    experiment_id = mlflow.experiment_id("bench-tracking-overhead")
    rates: dict[str, list[float]] = {"untracked": [], "tracked": []}
    live_points = []
    for pair in range(pairs):
        for side in ("untracked", "tracked"):
            run_dir = f"{run_root}-tracking-{pair}-{side}"
            config = dict(run_config)
            try:
                if side == "tracked":
                    run = mlflow.create_run(experiment_id, f"bench-{pair}", {}, int(time.time() * 1000))
                    hook.run(["mkdir", "-p", "--", run_dir])
                    hook.write_private(TrainingRunDir(run_dir).credentials, json.dumps(mlflow.job_credentials()))
                    config["tracking"] = {"uri": mlflow.tracking_uri_on_cluster, "run_id": run["info"]["run_id"],
                                          "credentials_file": CREDENTIALS_FILE}
                result = _run_job(hook, stack, config, run_dir, ranks=1, label=f"tracking-{pair}-{side}", **job)
                rates[side].append(result["rows_per_s"])
                if side == "tracked":
                    points = len(mlflow.metric_history(run["info"]["run_id"], "loss"))
                    live_points.append(points)
                    mlflow.finish_run(run["info"]["run_id"], "FINISHED", int(time.time() * 1000))
            finally:
                hook.run(["rm", "-rf", "--", run_dir])
    untracked, tracked = statistics.median(rates["untracked"]), statistics.median(rates["tracked"])
    ratio = tracked / untracked
    print(f"tracking overhead: {pairs} pairs of 1-rank jobs, median {untracked:.0f} rows/s untracked vs {tracked:.0f} "
          f"tracked (ratio {ratio:.3f}); loss points logged live per tracked job: {live_points}", flush=True)
    return {"tracked_over_untracked": round(ratio, 4), "slower_pct": round(100 * (1 - ratio), 2),
            "untracked_rows_per_s": rates["untracked"], "tracked_rows_per_s": rates["tracked"],
            "live_loss_points_per_job": live_points, "pairs": pairs}


def _on_slurm(preset_name: str, zero_stage: int, threads: int) -> dict:
    """jobs/train.py at 1 and 2 ranks on one node of the local Slurm, one job after the other."""
    stack = _stack_environment()
    from hybridflow.hooks.slurm import SlurmHook

    steps = int(_setting("JOB_STEPS", 5000))
    batch = int(_setting("JOB_BATCH", 256))
    customers = int(_setting("JOB_CUSTOMERS", 20_000))
    n_days = int(_setting("JOB_DAYS", 2))
    partition = str(_setting("JOB_PARTITION", "gpu-training"))
    timeout_s = float(_setting("JOB_TIMEOUT", 600))
    keep = str(_setting("JOB_KEEP", "0")) == "1"
    # Both jobs run on one node, so their ranks meet on the node's loopback. Left to itself the job takes the
    # first node's Slurm name (gpu-node-01), which nothing resolves on the local stack (its nodes are slurmds
    # on this machine, not hosts): the 2-rank job then waits in the rendezvous until it fails. "" lets the
    # job derive it from the node list, as a pipeline run does.
    master_addr = str(_setting("JOB_MASTER_ADDR", ""))
    env = {"MASTER_ADDR": master_addr} if master_addr else {}

    storage = stack["HYBRIDFLOW_STORAGE_ROOT"]
    code_dir = Path(stack["HYBRIDFLOW_CLUSTER_JOBS_DIR"]).parent
    tag = uuid.uuid4().hex[:8]
    features = Path(storage) / "features" / f"bench-{tag}"
    days = [(JOB_FIRST_DAY + timedelta(days=offset)).isoformat() for offset in range(n_days)]
    run_config = {
        "run_id": f"bench-training-{tag}", "labels": {"benchmark": "training"},
        "features_root": str(features), "ds_range": {"start": days[0], "end": days[-1]},
        "model": {"preset": preset_name}, "epochs": None, "max_steps": steps, "batch_size": batch,
        "learning_rate": 1e-3, "checkpoint_every_steps": steps, "seed": JOB_SEED, "zero_stage": zero_stage,
        "deepspeed_config": str(code_dir / "include" / "deepspeed" / "zero1.json"),
        "gpu_sample_every_s": 1.0, "torch_threads": threads,
    }
    run_dirs = {ranks: f"{storage}/runs/bench-training-{tag}-ranks{ranks}" for ranks in JOB_RANKS}
    hook = SlurmHook()
    runs: dict[int, dict] = {}
    try:
        _write_job_features(features, days, customers)
        print(f"training jobs: features {features} ({n_days} days x {customers} customers), preset {preset_name}, "
              f"micro-batch {batch} per rank, {steps} steps, torch_threads {threads}", flush=True)
        for ranks in JOB_RANKS:
            runs[ranks] = _run_job(hook, stack, run_config, run_dirs[ranks], ranks=ranks, tag=tag,
                                   partition=partition, timeout_s=timeout_s, env=env)
        tracking = _tracking_overhead(hook, stack, run_config, f"{storage}/runs/bench-training-{tag}",
                                      pairs=int(_setting("TRACKING_PAIRS", 3)), tag=tag, partition=partition,
                                      timeout_s=timeout_s, env=env) if int(_setting("TRACKING_PAIRS", 3)) else None
    finally:
        if keep:
            print(f"kept {features} and {', '.join(run_dirs.values())} (BENCH_TRAINING_JOB_KEEP=1)", flush=True)
        else:
            shutil.rmtree(features, ignore_errors=True)
            for run_dir in run_dirs.values():
                hook.run(["rm", "-rf", "--", run_dir])
        hook.close()

    one, two = runs[1]["rows_per_s"], runs[2]["rows_per_s"]
    share = _share_of(runs[2]["allreduce"])
    return {
        "ranks_1_rows_per_s": one,
        "ranks_2_rows_per_s": two,
        "scaling_efficiency": round(two / (2 * one), 3),
        "allreduce_share_in_job": _measured(share),
        "tracking_overhead": tracking or NOT_MEASURED,
        "runs": {f"ranks_{ranks}": run for ranks, run in runs.items()},
        "preset": preset_name,
        "micro_batch_per_rank": batch,
        "max_steps": steps,
        "rows": {"days": n_days, "customers_per_day": customers, "features": len(JOB_FEATURES)},
        "torch_threads": threads,
        "cpus_per_task": 1,
        "partition": partition,
        "master_addr": master_addr or "derived by the job from the node list",
        "zero_stage": zero_stage,
        "host_cpus": os.cpu_count(),
    }


def main() -> dict:
    preset_name = str(_setting("PRESET", "small"))
    zero_stage = int(_setting("ZERO_STAGE", 1))
    threads = int(_setting("THREADS", 1))
    torch.set_num_threads(threads)

    slurm = _on_slurm(preset_name, zero_stage, threads)  # first: the jobs need the cores this process would use
    result = _in_process(preset_name, zero_stage)
    result |= {key: slurm[key] for key in ("ranks_1_rows_per_s", "ranks_2_rows_per_s", "scaling_efficiency",
                                           "allreduce_share_in_job", "tracking_overhead")}
    tracking = result["tracking_overhead"]
    tracked_ratio = tracking["tracked_over_untracked"] if isinstance(tracking, dict) else NOT_MEASURED
    result["slurm"] = slurm
    print(
        f"RESULT training ranks_1_rows_per_s={result['ranks_1_rows_per_s']} "
        f"ranks_2_rows_per_s={result['ranks_2_rows_per_s']} "
        f"scaling_efficiency={result['scaling_efficiency']} "
        f"allreduce_share_in_job={result['allreduce_share_in_job']} "
        f"tracking_overhead={tracked_ratio} "
        f"deepspeed_steps_per_s={result['deepspeed_steps_per_s']} "
        f"torch_steps_per_s={result['torch_steps_per_s']} "
        f"deepspeed_rows_per_s={result['deepspeed_samples_per_s']} "
        f"tokens_per_s={result['tokens_per_s']} "
        f"mfu={_measured(result['mfu'])} "
        f"gpu_mean_util_pct={_measured(result['gpu'].get('mean_utilization_pct'))}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
