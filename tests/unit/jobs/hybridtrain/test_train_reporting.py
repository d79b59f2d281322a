"""What the training loop reports while it runs: progress.json and the step figures from rank 0 only, the
progress log line, metrics.json at the end."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from hybridtrain.config import ModelSpec
from hybridtrain.loop_window import LoopWindow
from hybridtrain.metrics import TOKEN_DEFINITION, run_metrics
from hybridtrain.plan import TrainingPlan
from hybridtrain.progress import ProgressReporter, read_progress
from hybridtrain.reporting import TrainingReports
from hybridtrain.state import TrainingState
from hybridtrain.tracking import StepMetricsLog

PLAN = TrainingPlan(n_train_rows=1280, batch_size=32, world_size=2, seed=11, steps_per_epoch=20, total_steps=60)


def reports(tmp_path: Path, rank: int) -> TrainingReports:
    progress = ProgressReporter(tmp_path / "progress.json", every_s=60.0, rows_per_step=PLAN.rows_per_step,
                                static={"total_steps": PLAN.total_steps})
    step_log = StepMetricsLog(tmp_path / "step_metrics.jsonl", PLAN.rows_per_step) if rank == 0 else None
    state = TrainingState(step=25, resumed_from=20, last_checkpoint=20)
    return TrainingReports(rank=rank, plan=PLAN, state=state, progress=progress, step_log=step_log)


def step_metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "step_metrics.jsonl").read_text().splitlines()]


def test_rank_0_writes_progress_step_figures_and_the_progress_line(tmp_path, caplog):
    report = reports(tmp_path, rank=0)
    report.state.record_loss(0.5)
    report.loss(0.5)
    assert report.report("training", force=True)
    assert not report.report("training")  # not due: every_s has not passed
    assert read_progress(tmp_path / "progress.json") | {"updated_at": None} == {
        "state": "training", "step": 25, "total_steps": 60, "epoch": 1, "last_checkpoint_step": 20,
        "resumed_from_step": 20, "loss": 0.5, "samples_per_s": None, "eta_s": None, "updated_at": None}
    with caplog.at_level(logging.INFO, logger="hybridtrain"):
        report.log_progress()
    assert caplog.messages == ["step 25/60 loss 0.5000 None samples/s eta None s"]

    report.state.evaluation = {"step": 25, "auc": 0.8, "log_loss": 0.45, "rows": 100, "positives": 30}
    report.evaluation()
    report.allreduce_share(26, step_s=0.2, comm_s=0.05)
    report.allreduce_share(51, step_s=0.2, comm_s=None)  # one rank: nothing to share
    report.allreduce_share(76, step_s=0.02, comm_s=0.05)  # a stalled rank, not a share: no step figure
    report.allreduce_share(101, step_s=0.0, comm_s=0.0)
    report.close()
    figures = [{k: v for k, v in line.items() if k != "timestamp_ms"} for line in step_metrics(tmp_path)]
    assert figures == [{"step": 25, "loss": 0.5}, {"step": 25, "holdout_auc": 0.8, "holdout_log_loss": 0.45},
                       {"step": 26, "allreduce_share": 0.25}]


def test_other_ranks_write_nothing(tmp_path):
    report = reports(tmp_path, rank=1)
    report.loss(0.5)
    report.state.evaluation = {"step": 25, "auc": 0.8, "log_loss": 0.45}
    report.evaluation()
    report.allreduce_share(26, step_s=0.2, comm_s=0.05)
    assert not report.report("completed", force=True)
    report.close()
    assert list(tmp_path.iterdir()) == []


def test_run_metrics_account_for_the_finished_run(tmp_path):
    config = SimpleNamespace(
        run_id="r1", labels={"team": "ml"}, holdout_fraction=0.2, run_dir=tmp_path, checkpoints_dir=tmp_path / "ck",
        model=ModelSpec(preset="tiny", hidden_sizes=(8, 4), dropout=0.0), zero_stage=2, collective_timeout_s=600,
        deepspeed_config=Path("/etc/zero2.json"), precision="auto", allreduce_sample_every_steps=25, batch_size=32,
        learning_rate=0.02, epochs=3, max_steps=None, seed=11, features_root="/st/features", ds=("2026-01-01",))
    data = SimpleNamespace(train_y=np.array([1, 0, 1, 0], dtype=np.float32), rows_per_partition={"2026-01-01": 5},
                           feature_columns=("a", "b"), fingerprint="f" * 64)
    state = TrainingState(step=60, resumed_from=40, last_checkpoint=60, train_wall_prior_s=2.0)
    state.loss_curve, state.last_loss = [[50, 0.5], [60, 0.4]], 0.4
    state.evaluation = {"step": 60, "auc": 0.8, "log_loss": 0.45, "rows": 100, "positives": 30}
    state.end_loop()
    engine = {"version": "0.19.8", "nodes": 1, "ranks": [], "device": "cpu", "dtype": "float32",
              "precision": "fp32", "gradient_clipping_by": "deepspeed", "fused_optimizer": False}
    clock = iter([100.0, 101.0, 103.0]).__next__
    loop = LoopWindow(clock)
    for step in (40, 50, 60):  # the resumed attempt's timed steps: 20 steps in 3 s
        loop.mark(step)
    train_wall_s = state.train_wall_s()
    metrics = run_metrics(config=config, plan=PLAN, data=data, state=state, restarts=1, wall_time_s=12.5,
                          time_split_s={"training_steps": 3.0}, loop=loop, n_parameters=50, n_trainable=50,
                          engine=engine, torch_version="2.x", exported={"dir": "export"})
    assert metrics["holdout"] == {"auc": 0.8, "log_loss": 0.45, "rows": 100, "positives": 30, "fraction": 0.2,
                                  "rule": metrics["holdout"]["rule"]}
    assert metrics["train"] == {"rows": 4, "positives": 2, "final_loss": 0.4}
    assert metrics["loss_curve"] == [{"step": 50, "loss": 0.5}, {"step": 60, "loss": 0.4}]
    assert metrics["train_rows_processed"] == metrics["train_tokens_processed"] == 60 * PLAN.rows_per_step
    assert metrics["token_definition"] == TOKEN_DEFINITION and metrics["restarts"] == 1
    assert metrics["train_wall_time_s"] == train_wall_s >= 2.0, "the loop's end, not when metrics.json is written"
    assert metrics["samples_per_s"] == metrics["loop"]["rows_per_s"] == round(20 * PLAN.rows_per_step / 3.0, 2)
    timed = metrics["loop"]
    assert (timed["from_step"], timed["to_step"], timed["step_ms_median"]) == (40, 60, 150.0)
    assert metrics["deepspeed"] == engine | {"zero_stage": 2, "world_size": 2, "collective_timeout_s": 600,
                                             "config": "/etc/zero2.json", "requested_precision": "auto"}
    assert metrics["model"] == {"preset": "tiny", "hidden_sizes": [8, 4], "dropout": 0.0, "n_parameters": 50}
    assert metrics["checkpoint"] == {"step": 60, "path": str(tmp_path / "ck" / "step_60"),
                                     "manifest": "MANIFEST.json"}
    assert metrics["gpu"]["gpu_available"] is False and metrics["mean_gpu_utilization_pct"] is None
    assert (metrics["status"], metrics["step"], metrics["epochs_completed"]) == ("completed", 60, 3)
    assert json.dumps(metrics, allow_nan=False)  # as write_json_atomic writes it

