"""`make bench BENCH=gpu` without CUDA: every path it measures on a GPU (the torch reference, the suite's training,
scoring and evaluation) runs on the CPU, and each GPU figure says `not_measured` instead of a number. Run as its own
process, as the benchmark runner does (the training job sets the process's environment and signal handlers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
GPU_FIGURES = ("train_ref_rows_per_s", "train_rows_per_s", "train_ratio", "train_gpu_util_pct", "train_step_ms",
               "train_host_syncs_per_step", "score_rows_per_s", "score_ref_rows_per_s", "score_ratio", "evaluate_s")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_gpu_bench_runs_every_path_on_cpu_and_invents_no_gpu_figure():
    env = {**os.environ, "BENCH_GPU_ROWS": "1500", "BENCH_GPU_STEPS": "12", "BENCH_GPU_BATCH": "128",
           "BENCH_GPU_PRESET": "tiny"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gpu.py")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT gpu device=cpu preset=tiny batch=128 steps=12 "), last
    figures = dict(item.split("=", 1) for item in last.split()[2:])
    assert {key: figures[key] for key in GPU_FIGURES} == dict.fromkeys(GPU_FIGURES, "not_measured")
    assert figures["train_precision"] == figures["score_precision"] == "fp32"
    assert float(figures["auc_diff"]) < 0.1
    # the CPU paths ran: both trainings, the scorer over a published partition, the evaluation
    for path in ("reference training", "suite training", "scoring"):
        assert re.search(rf"^{path}: \{{'rows_per_s': [0-9.]+", done.stdout, flags=re.M), path
    phases = r"\{'read': [0-9.]+, 'hash': [0-9.]+, 'load': [0-9.]+, 'score': [0-9.]+, 'metrics': [0-9.]+\}"
    assert re.search(rf"^evaluation: \{{'seconds': [0-9.]+, 'rows': [1-9]\d*, 'device': 'cpu', 'phases_s': {phases}\}}",
                     done.stdout, re.M)
    # the suite's figures are its loop's, from the first timed step on
    assert re.search(r"^suite training: \{'rows_per_s': [0-9.]+, 'step_ms_median': [0-9.]+, 'loop_steps': '1-12'",
                     done.stdout, re.M)
