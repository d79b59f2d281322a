"""jobs/train.py end to end: real DeepSpeed (gloo on CPU, one process or two under torchrun), the tiny preset,
synthetic partitions.

Each test starts the job as the Slurm batch script does (``python jobs/train.py --config ...``), or as torchrun
starts ranks, and reads what it leaves in its run directory. Partitions are written here in the features job's
contract, with a planted signal so the holdout AUC is clearly above 0.5.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hybridtrain.checkpoints import MANIFEST_NAME, checkpoint_steps, verify_checkpoint
from hybridtrain.launch import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "jobs" / "train.py"

FEATURES = ["spend_30d", "visits_7d", "basket_mean", "discount_share", "support_calls", "tenure_days"]
DAYS = ("2026-01-01", "2026-01-02")
CUSTOMERS = 1500
BATCH = 32
EPOCHS = 4
CHECKPOINT_EVERY = 25
RUN_TIMEOUT_S = 120
NODE = platform.node().split(".")[0]


def write_features(root: Path, ds: str, day: int) -> None:
    """One partition as the Spark features job publishes it: Parquet parts, _MANIFEST.json, then _SUCCESS."""
    rng = np.random.default_rng(day)
    x = rng.normal(size=(CUSTOMERS, 5))
    logit = 1.6 * x[:, 0] - 1.2 * x[:, 1] + 0.9 * x[:, 2] * x[:, 3] - 0.4
    labels = (rng.random(CUSTOMERS) < 1 / (1 + np.exp(-logit))).astype(np.int32)
    table = pa.table(
        {"customer_id": [f"cust-{i:06d}" for i in range(CUSTOMERS)], "label": labels}
        | {name: (x[:, i] * 10 + 50).astype(np.float32) for i, name in enumerate(FEATURES[:5])}
        | {"tenure_days": rng.integers(0, 3650, CUSTOMERS)}
    )
    directory = root / f"ds={ds}"
    directory.mkdir(parents=True)
    half = CUSTOMERS // 2
    pq.write_table(table.slice(half), directory / "part-00000-x.snappy.parquet")
    pq.write_table(table.slice(0, half), directory / "part-00001-x.snappy.parquet")
    (directory / "_MANIFEST.json").write_text(json.dumps({"feature_columns": FEATURES, "ds": ds}))
    (directory / "_SUCCESS").write_text("")


@pytest.fixture(scope="module")
def features_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("features")
    for day, ds in enumerate(DAYS):
        write_features(root, ds, day)
    return root


def write_run_config(directory: Path, features_root: Path, **changes: object) -> Path:
    config = {
        "run_id": f"test_{directory.name}",
        "features_root": str(features_root),
        "ds_range": {"start": DAYS[0], "end": DAYS[-1]},
        "run_dir": str(directory / "run"),
        "model": {"preset": "tiny"},
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "learning_rate": 0.02,
        "checkpoint_every_steps": CHECKPOINT_EVERY,
        "seed": 11,
        "zero_stage": 1,
        "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero1.json"),
        "log_every_steps": 5,
        "progress_every_s": 0.2,
        "torch_threads": 1,
    } | changes
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "run.json"
    path.write_text(json.dumps(config))
    return path


def job_environment(**extra: str) -> dict[str, str]:
    """The caller's environment without launcher or Slurm variables, plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in launcher}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


class Job:
    """One ``python jobs/train.py`` process with its output in ``<config dir>/<name>.log``."""

    def __init__(self, config: Path, name: str = "job", launcher: tuple[str, ...] = (), **env: str) -> None:
        self.config = config
        self.run_dir = Path(json.loads(config.read_text())["run_dir"])
        self.log_path = config.parent / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*(launcher or (sys.executable,)), str(TRAIN), "--config", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=job_environment(**env),
            cwd=config.parent,
        )

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"training did not end within {timeout_s} s:\n{self.output[-4000:]}")
        finally:
            self._log.close()

    def progress(self) -> dict:
        try:
            return json.loads((self.run_dir / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_for_progress(self, predicate, what: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            progress = self.progress()
            if progress and predicate(progress):
                return progress
            if self.process.poll() is not None:
                pytest.fail(
                    f"training exited ({self.process.returncode}) before {what}:\n{self.output[-4000:]}"
                )
            time.sleep(0.02)
        self.process.kill()
        pytest.fail(f"no {what} within {timeout_s} s; progress {self.progress()}:\n{self.output[-4000:]}")


def run_to_end(config: Path, name: str = "job", **env: str) -> Job:
    job = Job(config, name, **env)
    code = job.wait()
    assert code == 0, f"exit {code}:\n{job.output[-4000:]}"
    return job


def metrics_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def baseline(features_root, tmp_path_factory) -> Job:
    """An uninterrupted run; the interrupted ones must end where it ended, with the same results."""
    return run_to_end(write_run_config(tmp_path_factory.mktemp("baseline"), features_root))


def test_training_job_writes_metrics_checkpoints_progress_and_export(baseline):
    run_dir = baseline.run_dir
    metrics = metrics_of(run_dir)
    total = metrics["total_steps"]
    assert metrics["status"] == "completed"
    assert metrics["step"] == total == EPOCHS * metrics["steps_per_epoch"]
    assert metrics["steps_per_epoch"] == metrics["train"]["rows"] // BATCH
    assert metrics["train"]["rows"] + metrics["holdout"]["rows"] == len(DAYS) * CUSTOMERS
    assert metrics["holdout"]["auc"] > 0.75, metrics["holdout"]
    assert metrics["holdout"]["log_loss"] < 0.6, metrics["holdout"]
    curve = metrics["loss_curve"]
    assert [point["step"] for point in curve] == list(range(5, total + 1, 5))
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert metrics["train_rows_processed"] == metrics["train_tokens_processed"] == total * BATCH
    assert metrics["wall_time_s"] >= metrics["train_wall_time_s"] > 0
    assert (metrics["restarts"], metrics["resumed_from_step"]) == (0, None)
    assert metrics["model"]["preset"] == "tiny" and metrics["model"]["n_parameters"] > 0
    assert metrics["deepspeed"] | {"config": None} == {
        "version": metrics["deepspeed"]["version"],
        "zero_stage": 1,
        "world_size": 1,
        "nodes": 1,
        "ranks": [{"rank": 0, "node": NODE, "local_rank": 0}],
        "collective_timeout_s": 300.0,
        "config": None,
        "device": "cpu",
        "dtype": "float32",
        "precision": "fp32",  # precision auto: float32 on CPUs
        "requested_precision": "auto",
        "gradient_clipping_by": "loop",  # on the device before each step, ZeRO-1 too
        "fused_optimizer": False,
    }
    assert f"rank0@{NODE} INFO hybridtrain: ranks: 0@{NODE}" in baseline.output
    allreduce = metrics["allreduce"]
    assert (allreduce["share"], allreduce["comm_ms_median"], allreduce["world_size"]) == (None, None, 1)
    assert allreduce["reason"] == "one rank: no gradient all-reduce"
    assert allreduce["samples"] == total // 25 and allreduce["step_ms_median"] > 0
    assert metrics["hyperparameters"] | {"learning_rate": None, "seed": None} == {
        "batch_size": BATCH,
        "micro_batch": BATCH,
        "accumulation": 1,
        "global_batch": BATCH,
        "epochs": EPOCHS,
        "max_steps": None,
        "learning_rate": None,
        "seed": None,
    }
    assert metrics["data"]["feature_columns"] == FEATURES
    assert metrics["data"]["rows_per_partition"] == dict.fromkeys(DAYS, CUSTOMERS)

    steps = [step for step, _ in checkpoint_steps(run_dir / "checkpoints")]
    assert steps == sorted({*range(CHECKPOINT_EVERY, total + 1, CHECKPOINT_EVERY), total}, reverse=True)
    final = verify_checkpoint(run_dir / "checkpoints" / f"step_{total}")
    assert final.ok, final.reason
    assert final.manifest["epoch"] == EPOCHS
    assert final.manifest["metrics"]["holdout_auc"] == metrics["holdout"]["auc"]
    assert {entry["path"] for entry in final.manifest["files"]} >= {"mp_rank_00_model_states.pt"}
    assert metrics["checkpoint"]["step"] == total

    progress = baseline.progress()
    assert progress | {"updated_at": None, "loss": None, "samples_per_s": None} == {
        "state": "completed",
        "step": total,
        "total_steps": total,
        "epoch": EPOCHS,
        "epochs_total": EPOCHS,
        "restarts": 0,
        "resumed_from_step": None,
        "last_checkpoint_step": total,
        "slurm_job_id": None,
        "run_id": metrics["run_id"],
        "ranks": f"0@{NODE}",  # the placement, for the orchestrator's log
        "eta_s": 0.0,
        "updated_at": None,
        "loss": None,
        "samples_per_s": None,
    }
    assert progress["samples_per_s"] > 0 and progress["loss"] > 0


def test_training_job_reports_absent_gpus_without_inventing_numbers(baseline):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    samples = baseline.run_dir / "gpu_metrics.rank0.jsonl"
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 1
    assert records[0]["gpu_available"] is False and records[0]["reason"] == "nvidia-smi not found"
    assert records[0]["rank"] == 0
    metrics = metrics_of(baseline.run_dir)
    assert metrics["mean_gpu_utilization_pct"] is None
    assert metrics["gpu"]["gpu_available"] is False and metrics["gpu"]["samples"] == 0


def test_training_job_export_serves_the_documented_signature(baseline):
    import torch

    export = baseline.run_dir / "export"
    signature = json.loads((export / "signature.json").read_text())
    assert signature["feature_columns"] == FEATURES and signature["n_features"] == len(FEATURES)
    assert signature["inputs"][0]["name"] == "INPUT__0" and signature["outputs"][0]["name"] == "OUTPUT__0"
    smoke = json.loads((export / "smoke.json").read_text())
    assert len(smoke["inputs"]) == 16
    model = torch.jit.load(str(export / "model.pt"))
    outputs = model(torch.tensor(smoke["inputs"], dtype=torch.float32))
    assert outputs.dtype == torch.float32 and tuple(outputs.shape) == (16, 1)
    np.testing.assert_allclose(outputs.detach().numpy(), np.array(smoke["outputs"]), atol=smoke["atol"])
    assert metrics_of(baseline.run_dir)["export"]["max_abs_diff_vs_engine"] < 1e-5
    assert not (baseline.run_dir / "torch_extensions").exists(), "no DeepSpeed op was JIT-built"


def test_training_job_resumes_after_sigkill_and_ends_like_an_uninterrupted_run(
    baseline, features_root, tmp_path
):
    config = write_run_config(tmp_path, features_root)
    first = Job(config, "first")
    killed_at = first.wait_for_progress(
        lambda p: (p.get("last_checkpoint_step") or 0) >= CHECKPOINT_EVERY, "a first complete checkpoint"
    )
    first.process.send_signal(signal.SIGKILL)
    first.wait()
    checkpoint = killed_at["last_checkpoint_step"]
    assert verify_checkpoint(first.run_dir / "checkpoints" / f"step_{checkpoint}").ok
    assert not (first.run_dir / "metrics.json").exists()

    second = run_to_end(config, "second")
    metrics, expected = metrics_of(second.run_dir), metrics_of(baseline.run_dir)
    resumed_from = metrics["resumed_from_step"]
    assert resumed_from >= checkpoint and resumed_from % CHECKPOINT_EVERY == 0
    assert (
        f"resumed from {second.run_dir / 'checkpoints'}/step_{resumed_from} at step {resumed_from}"
        in second.output
    )
    assert metrics["step"] == metrics["total_steps"] == expected["step"]
    assert metrics["restarts"] == 1
    assert [point["step"] for point in metrics["loss_curve"]] == [
        point["step"] for point in expected["loss_curve"]
    ]
    losses = [point["loss"] for point in metrics["loss_curve"]]
    assert losses == pytest.approx([point["loss"] for point in expected["loss_curve"]], abs=1e-5)
    assert metrics["holdout"]["auc"] == pytest.approx(expected["holdout"]["auc"], abs=1e-6)
    assert metrics["holdout"]["log_loss"] == pytest.approx(expected["holdout"]["log_loss"], abs=1e-6)


def test_training_job_skips_a_corrupt_newest_checkpoint(baseline, features_root, tmp_path):
    config = write_run_config(tmp_path, features_root)
    run_dir = tmp_path / "run"
    shutil.copytree(baseline.run_dir / "checkpoints", run_dir / "checkpoints")
    (newest, newest_dir), (second, second_dir), (third, _) = checkpoint_steps(run_dir / "checkpoints")[:3]
    optim = next(newest_dir.glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-10])
    (second_dir / MANIFEST_NAME).unlink()
    (run_dir / "checkpoints" / f"step_{newest + 5}.tmp").mkdir()

    job = run_to_end(config)
    assert f"skipping checkpoint {newest_dir}: {optim.name} has" in job.output
    assert f"skipping checkpoint {second_dir}: no MANIFEST.json" in job.output
    metrics = metrics_of(run_dir)
    assert metrics["resumed_from_step"] == third
    assert metrics["step"] == newest == metrics_of(baseline.run_dir)["step"]
    assert metrics["holdout"]["auc"] == pytest.approx(
        metrics_of(baseline.run_dir)["holdout"]["auc"], abs=1e-6
    )
    assert verify_checkpoint(newest_dir).ok and verify_checkpoint(second_dir).ok, (
        "rewritten by the resumed run"
    )


@pytest.mark.parametrize(
    ("signum", "exit_code", "message"),
    [
        (signal.SIGUSR2, 75, "SLURM_JOB_ID is not set: not requeueing"),
        (signal.SIGTERM, 143, "SIGTERM received: stopping at step"),
    ],
    ids=["sigusr2-without-slurm-exits-75", "sigterm-exits-143"],
)
def test_training_job_checkpoints_and_stops_on_signal(features_root, tmp_path, signum, exit_code, message):
    # Under Slurm too, SIGTERM (scancel, time limit) must not requeue: the user or Slurm decided.
    slurm = {"SLURM_JOB_ID": "4242"} if signum == signal.SIGTERM else {}
    job = Job(write_run_config(tmp_path, features_root), **slurm)
    job.wait_for_progress(lambda p: p.get("state") == "training" and p.get("step", 0) >= 3, "training steps")
    job.process.send_signal(signum)
    code = job.wait()
    assert code == exit_code, f"exit {code}:\n{job.output[-4000:]}"
    progress = job.progress()
    assert progress["state"] == "stopped"
    step = progress["step"]
    assert progress["last_checkpoint_step"] == step > 0
    check = verify_checkpoint(job.run_dir / "checkpoints" / f"step_{step}")
    assert check.ok, check.reason
    assert f"{signum.name} received: stopping at step {step}" in job.output
    assert message in job.output
    assert "requeueing Slurm job" not in job.output, "only SIGUSR2 under Slurm requeues"
    assert not (job.run_dir / "metrics.json").exists()


def fake_scontrol(directory: Path, exit_code: int) -> str:
    """scontrol on PATH that records its arguments: requeueing for real is the Slurm operator's test."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{directory}/scontrol.args"\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_training_job_requeues_itself_on_sigusr2_and_resumes_on_restart(baseline, features_root, tmp_path):
    config = write_run_config(tmp_path, features_root)
    path = fake_scontrol(tmp_path, 0)
    job = Job(config, "first", PATH=path, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    job.wait_for_progress(lambda p: p.get("state") == "training" and p.get("step", 0) >= 3, "training steps")
    job.process.send_signal(signal.SIGUSR2)
    code = job.wait()
    assert code == 0, f"exit {code}:\n{job.output[-4000:]}"
    assert (tmp_path / "scontrol.args").read_text() == "requeue 4242\n"
    stopped = job.progress()
    assert (stopped["state"], stopped["slurm_job_id"]) == ("stopped", "4242")

    restarted = run_to_end(config, "restart", PATH=path, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")
    metrics = metrics_of(restarted.run_dir)
    assert (metrics["restarts"], metrics["resumed_from_step"]) == (1, stopped["last_checkpoint_step"])
    assert metrics["step"] == metrics_of(baseline.run_dir)["step"]
    assert metrics["holdout"]["auc"] == pytest.approx(
        metrics_of(baseline.run_dir)["holdout"]["auc"], abs=1e-6
    )
    assert (tmp_path / "scontrol.args").read_text() == "requeue 4242\n", "no second requeue"


def test_training_job_requeue_failure_exits_76_with_scontrol_message(features_root, tmp_path):
    job = Job(write_run_config(tmp_path, features_root), PATH=fake_scontrol(tmp_path, 1), SLURM_JOB_ID="4242")
    job.wait_for_progress(lambda p: p.get("state") == "training" and p.get("step", 0) >= 3, "training steps")
    job.process.send_signal(signal.SIGUSR2)
    assert job.wait() == 76
    assert "`scontrol requeue 4242` exited 1" in job.output
    progress = job.progress()
    assert progress["state"] == "failed" and "scontrol requeue 4242" in progress["error"]
    assert verify_checkpoint(job.run_dir / "checkpoints" / f"step_{progress['last_checkpoint_step']}").ok


def test_training_job_zero_stage_3_checkpoints_resume_and_export(features_root, tmp_path):
    zero3 = {"zero_stage": 3, "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero3.json")}
    first = run_to_end(write_run_config(tmp_path, features_root, epochs=None, max_steps=40, **zero3), "first")
    assert metrics_of(first.run_dir)["step"] == 40
    extended = run_to_end(
        write_run_config(tmp_path, features_root, epochs=None, max_steps=60, **zero3), "second"
    )
    metrics = metrics_of(extended.run_dir)
    assert (metrics["resumed_from_step"], metrics["step"], metrics["deepspeed"]["zero_stage"]) == (40, 60, 3)
    assert metrics["holdout"]["auc"] > 0.6
    assert verify_checkpoint(extended.run_dir / "checkpoints" / "step_60").ok
    assert metrics["export"]["max_abs_diff_vs_engine"] < 1e-5, "the export gathered the partitioned weights"


def test_training_job_bf16_engine_exports_float32(features_root, tmp_path):
    bf16 = {"zero_stage": 2, "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero2_bf16.json")}
    job = run_to_end(write_run_config(tmp_path, features_root, epochs=None, max_steps=40, **bf16))
    metrics = metrics_of(job.run_dir)
    assert metrics["deepspeed"]["dtype"] == "bfloat16"
    assert metrics["holdout"]["auc"] > 0.6
    assert 0 <= metrics["export"]["max_abs_diff_vs_engine"] < 2e-2, "bf16 engine, float32 export"
    signature = json.loads((job.run_dir / "export" / "signature.json").read_text())
    assert signature["inputs"][0]["dtype"] == "float32"


def test_training_job_zero0_bf16_autocast_clips_in_the_loop_resumes_and_checks_bf16_scoring(features_root, tmp_path):
    """The one-node GPU settings on CPU autocast (CI has no GPU): ZeRO stage 0, float32 weights under bf16
    autocast, clipping by the loop; a resume ends at the same step; the export records its bf16 check."""
    fast = {"zero_stage": 0, "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero0.json"),
            "precision": "bf16"}
    run_to_end(write_run_config(tmp_path, features_root, epochs=None, max_steps=40, **fast), "first")
    job = run_to_end(write_run_config(tmp_path, features_root, epochs=None, max_steps=60, **fast), "second")
    metrics = metrics_of(job.run_dir)
    deepspeed = metrics["deepspeed"]
    assert (metrics["resumed_from_step"], metrics["step"]) == (40, 60)
    assert (deepspeed["zero_stage"], deepspeed["dtype"], deepspeed["precision"], deepspeed["gradient_clipping_by"]) \
        == (0, "float32", "bf16-autocast", "loop")
    assert deepspeed["fused_optimizer"] is False, "fused AdamW only on CUDA"
    assert metrics["holdout"]["auc"] > 0.6
    assert metrics["export"]["max_abs_diff_vs_engine"] < 1e-5, "float32 weights: the export matches the engine"
    precision = json.loads((job.run_dir / "export" / "signature.json").read_text())["precision"]
    assert precision["check"]["labelled_rows"] > 0 and precision["check"]["auc_loss_se"] is not None
    assert precision["scoring"] == ("bf16" if precision["check"]["max_abs_diff"] <= 0.01
                                    and precision["check"]["auc_loss_bound"] <= 0.001 else "fp32")
    assert "compute: bf16-autocast on cpu; gradient clipping by the loop" in job.output


def test_training_job_two_processes_shard_zero2_and_stop_together(features_root, tmp_path):
    """torchrun with two gloo processes: ZeRO-2 shards in the manifest, and a signal to rank 0 stops both."""
    port = free_port()
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}")
    zero2 = {"zero_stage": 2, "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero2.json")}
    job = Job(write_run_config(tmp_path, features_root, **zero2), launcher=torchrun)
    job.wait_for_progress(lambda p: (p.get("last_checkpoint_step") or 0) >= CHECKPOINT_EVERY, "a checkpoint")
    rank0 = _worker_with_rank(job.process.pid, "0")
    os.kill(rank0, signal.SIGUSR2)
    job.wait()
    progress = job.progress()
    assert progress["state"] == "stopped"
    step = progress["step"]
    assert f"rank0@{NODE} WARNING hybridtrain: SIGUSR2 received: stopping at step {step}" in job.output
    assert f"rank1@{NODE} WARNING hybridtrain: SIGUSR2 received: stopping at step {step}" in job.output
    check = verify_checkpoint(job.run_dir / "checkpoints" / f"step_{progress['last_checkpoint_step']}")
    assert check.ok, check.reason
    files = {entry["path"] for entry in check.manifest["files"]}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
    assert check.manifest["world_size"] == 2
    assert check.manifest["resume_key"]["plan"]["world_size"] == 2


def _worker_with_rank(launcher_pid: int, rank: str) -> int:
    """The pid of torchrun's worker process with RANK=``rank``."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{launcher_pid}\n" not in status.read_text():
                continue
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(status.parent.name)
    pytest.fail(f"no worker with RANK={rank} under pid {launcher_pid}")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 0, "zero_stage": 7}, "batch_size: must be an integer >= 1"),
        ({"ds_range": {"start": "2025-12-31", "end": "2026-01-01"}}, "ds=2025-12-31 does not exist"),
        ({"batch_size": 100_000}, "batch_size: 100000 x 1 accumulation steps x 1 processes needs more rows"),
    ],
    ids=["invalid-config", "missing-partition", "batch-larger-than-data"],
)
def test_training_job_rejects_bad_input_with_exit_2(features_root, tmp_path, changes, message):
    job = Job(write_run_config(tmp_path, features_root, **changes))
    assert job.wait() == 2
    assert message in job.output
    assert "Traceback" not in job.output


def test_training_job_changed_data_refuses_to_resume(baseline, features_root, tmp_path):
    config = write_run_config(tmp_path, features_root, ds_range={"start": DAYS[0], "end": DAYS[0]})
    shutil.copytree(baseline.run_dir / "checkpoints", tmp_path / "run" / "checkpoints")
    job = Job(config)
    assert job.wait() == 2
    assert "belongs to a different run (differs in data_sha256, plan)" in job.output
    assert job.progress()["state"] == "failed"


# --- several ranks: the all-reduce share, rank placement, batch splits, world-size changes, dead peers ----------

SPLIT_MICRO_BATCH = 16
SPLIT_STEPS = 40
SPLIT_SAMPLE_EVERY = 5
# Same global batch of 32 rows, split three ways; no dropout, so every split computes the same mean gradient
# and only float summation order differs.
SPLITS = {
    "two_ranks": ({"batch_size": SPLIT_MICRO_BATCH}, 2),
    "one_rank_double_batch": ({"batch_size": 2 * SPLIT_MICRO_BATCH}, 1),
    "one_rank_accumulating": ({"batch_size": SPLIT_MICRO_BATCH, "gradient_accumulation_steps": 2}, 1),
}
# Measured: identical loss curves at metrics.json's 6 decimals, exports within 6e-8 (float32 summation order).
LOSS_TOLERANCE = 1e-5


def torchrun(nproc: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}")


def split_config(directory: Path, features_root: Path, **changes: object) -> Path:
    split = {
        "model": {"hidden_sizes": [16], "dropout": 0.0},
        "epochs": None,
        "max_steps": SPLIT_STEPS,
        "checkpoint_every_steps": 20,
        "allreduce_sample_every_steps": SPLIT_SAMPLE_EVERY,
    }
    return write_run_config(directory, features_root, **(split | changes))


@pytest.fixture(scope="module")
def split_runs(features_root, tmp_path_factory) -> dict[str, Job]:
    """The same 40 steps with a global batch of 32: 2 ranks x 16, 1 rank x 32, 1 rank x 2 micro-batches of 16.
    The two single-process runs share the machine's two cores after the torchrun one."""
    jobs = {}
    for name, (changes, ranks) in SPLITS.items():
        config = split_config(tmp_path_factory.mktemp(name), features_root, **changes)
        jobs[name] = Job(config, name, launcher=torchrun(ranks) if ranks > 1 else ())
        if ranks > 1:
            jobs[name].wait()
    for name, job in jobs.items():
        if job.process.returncode is None:
            job.wait()
        assert job.process.returncode == 0, f"{name} exit {job.process.returncode}:\n{job.output[-4000:]}"
    return jobs


def test_training_job_two_ranks_measure_the_allreduce_share_and_list_their_placement(split_runs):
    job = split_runs["two_ranks"]
    metrics = metrics_of(job.run_dir)
    allreduce = metrics["allreduce"]
    assert allreduce["world_size"] == 2 and "reason" not in allreduce
    assert allreduce["samples"] == SPLIT_STEPS // SPLIT_SAMPLE_EVERY
    assert [point[0] for point in allreduce["series"]] == list(range(5, SPLIT_STEPS + 1, 5))
    assert allreduce["comm_ms_median"] > 0 and allreduce["step_ms_median"] > 0
    assert allreduce["share"] == pytest.approx(allreduce["comm_ms_median"] / allreduce["step_ms_median"], abs=1e-3)
    assert 0 < allreduce["share"] < 1
    assert allreduce["elements"] == metrics["model"]["n_parameters"] == 6 * 16 + 16 + 16 + 1
    assert "dist.all_reduce of a float32 buffer of 129 elements" in allreduce["method"]

    assert (metrics["deepspeed"]["world_size"], metrics["deepspeed"]["nodes"]) == (2, 1)
    assert metrics["deepspeed"]["ranks"] == [
        {"rank": 0, "node": NODE, "local_rank": 0},
        {"rank": 1, "node": NODE, "local_rank": 1},
    ]
    assert f"rank0@{NODE} INFO hybridtrain: ranks: 0@{NODE}, 1@{NODE}" in job.output
    assert f"rank1@{NODE} INFO" not in job.output, "ranks other than 0 log warnings and errors only"
    assert metrics["hyperparameters"]["global_batch"] == 2 * SPLIT_MICRO_BATCH

    check = verify_checkpoint(job.run_dir / "checkpoints" / f"step_{SPLIT_STEPS}")
    assert check.ok and check.manifest["world_size"] == 2
    assert {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)} <= {
        entry["path"] for entry in check.manifest["files"]
    }
    if not shutil.which("nvidia-smi"):
        for rank in (0, 1):
            (record,) = [json.loads(line) for line in (job.run_dir / f"gpu_metrics.rank{rank}.jsonl").open()]
            assert (record["rank"], record["gpu_available"]) == (rank, False)
        assert metrics["gpu"]["reason"] == "nvidia-smi not found"


def test_training_job_same_global_batch_gives_the_same_loss_curve_however_it_is_split(split_runs):
    """2 ranks x 16 rows, 1 rank x 32 rows and 1 rank x 2 accumulated micro-batches of 16 take the same rows per
    step (the plan numbers slices micro-batch first, then rank) and the same mean gradient (DeepSpeed averages
    over ranks and divides each micro-batch's loss by the accumulation count), so they train alike: loss curves,
    holdout AUC and the exported model's outputs agree within LOSS_TOLERANCE."""
    metrics = {name: metrics_of(job.run_dir) for name, job in split_runs.items()}
    reference = metrics["two_ranks"]
    steps = [point["step"] for point in reference["loss_curve"]]
    assert steps == list(range(5, SPLIT_STEPS + 1, 5))
    for name, other in metrics.items():
        hyper = other["hyperparameters"]
        assert (hyper["global_batch"], other["train_rows_processed"]) == (32, 32 * SPLIT_STEPS), name
        assert [point["step"] for point in other["loss_curve"]] == steps, name
        differences = [
            abs(a["loss"] - b["loss"]) for a, b in zip(other["loss_curve"], reference["loss_curve"], strict=True)
        ]
        assert max(differences) <= LOSS_TOLERANCE, f"{name}: {differences}"
        assert other["holdout"]["auc"] == pytest.approx(reference["holdout"]["auc"], abs=LOSS_TOLERANCE), name
        outputs = [json.loads((split_runs[run].run_dir / "export" / "smoke.json").read_text())["outputs"] for run in
                   (name, "two_ranks")]
        np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=LOSS_TOLERANCE, err_msg=name)
    assert metrics["one_rank_accumulating"]["hyperparameters"]["accumulation"] == 2
    assert metrics["one_rank_double_batch"]["hyperparameters"]["micro_batch"] == 32


def test_training_job_refuses_a_checkpoint_of_two_ranks_in_a_one_rank_run(split_runs, features_root, tmp_path):
    written = split_runs["two_ranks"].run_dir / "checkpoints"
    config = split_config(tmp_path, features_root, batch_size=SPLIT_MICRO_BATCH, max_steps=SPLIT_STEPS + 20)
    shutil.copytree(written, tmp_path / "run" / "checkpoints")
    job = Job(config)
    assert job.wait() == 2, job.output[-4000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    message = (
        f"checkpoint {checkpoints}/step_{SPLIT_STEPS} was written by 2 ranks; this run has 1: resume with nodes x "
        f"gpus_per_node = 2 ranks, or start the run over (delete {checkpoints}, or use a new run_dir)"
    )
    assert message in job.output
    assert "differs in" not in job.output
    progress = job.progress()
    assert (progress["state"], progress["step"]) == ("failed", 0), "failed before the first step"
    assert message in progress["error"]
    assert "step 1/" not in job.output and "Traceback" not in job.output
    assert [step for step, _ in checkpoint_steps(checkpoints)] == [SPLIT_STEPS, 20], "nothing new written"


def test_training_job_a_stuck_peer_ends_the_job_after_collective_timeout_s(features_root, tmp_path):
    """SIGSTOP freezes rank 1 (alive, so torchrun does not notice): rank 0's next collective gives up after
    collective_timeout_s instead of hanging until Slurm's time limit."""
    timeout_s = 4
    long_run = {"epochs": None, "max_steps": 100_000, "collective_timeout_s": timeout_s}  # killed long before
    job = Job(write_run_config(tmp_path, features_root, **long_run), launcher=torchrun(2))
    job.wait_for_progress(lambda p: p.get("state") == "training" and p.get("step", 0) >= 3, "training steps")
    rank0, rank1 = (_worker_with_rank(job.process.pid, rank) for rank in ("0", "1"))
    os.kill(rank1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        while Path(f"/proc/{rank0}").exists() and time.monotonic() - stopped_at < 60:
            time.sleep(0.1)
        waited = time.monotonic() - stopped_at
    finally:
        os.kill(rank1, signal.SIGKILL)
    job.wait()
    assert timeout_s <= waited < timeout_s + 20, f"rank 0 ended {waited:.1f} s after its peer froze:\n{job.output}"
    progress = job.progress()
    assert progress["state"] == "failed"
    message = f"a collective operation failed (collective_timeout_s={timeout_s}): another rank is dead, stuck"
    assert f"rank0@{NODE} ERROR hybridtrain: {message}" in job.output
    assert progress["error"].startswith(f"CollectiveError: {message}")
    assert "Timed out waiting 4000ms" in progress["error"]
