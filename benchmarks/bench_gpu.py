"""Benchmark `gpu`: in one process, the plain torch reference and the suite's own training, scoring and evaluation
on the same model, batch and data; prints the ratios and the GPU utilization (issue 21).

- Data: ``BENCH_GPU_DAYS`` published feature partitions of ``BENCH_GPU_ROWS`` customers each (tests/helpers/
  feature_partitions.py: 4 features, a planted signal), in a temporary storage root.
- Reference: the MLP of ``BENCH_GPU_PRESET`` with torch's AdamW (fused on CUDA), clipping 1.0, BCE on logits, the
  training rows already on the device, bf16 autocast on CUDA (float32 on CPUs): rows/s over ``BENCH_GPU_STEPS``
  steps after a warm-up, then its holdout AUC after those steps (the same split and standardisation as the job).
- The suite's training: ``jobs/train.py``'s own ``main`` in this process (one rank; zero0.json, precision auto,
  batch ``BENCH_GPU_BATCH``, ``max_steps`` = the reference's steps, the loss read every eighth of them, at most
  50): its ``metrics.json`` ``loop`` (rows/s and median step from the first to the last timed step, so warm-up,
  start-up, checkpoint, evaluation and export stay out, as they do of the reference; GPU utilization of its
  nvidia-smi samples inside those steps), holdout AUC and compute precision; the rest of its time per phase.
- Scoring: ``score_batch_local``'s ``run`` over one published partition with the exported model (precision auto:
  bf16 where the export's check allowed it), Parquet read and write included, against the reference's scoring of
  rows already on the device in the same precision.
- Evaluation: ``jobs/evaluate.py``'s ``evaluate`` of the exported model against itself as champion (two models
  on the same holdout, the nightly's evaluation; one file, so loaded and scored once), with its phases.
- Host syncs (CUDA only): the suite's training twice more, 50 and 100 steps, under
  ``torch.cuda.set_sync_debug_mode("warn")``; the difference of the warnings counted, over 50, is the loop's
  host synchronizations per step (start-up and the end count the same in both runs).

Without CUDA every GPU figure prints ``not_measured`` and the paths still run on the CPU (small defaults), so the
benchmark checks that each path works. Prints ``RESULT gpu device=... train_ratio=... train_gpu_util_pct=...
train_step_ms=... auc_diff=... score_rows_per_s=... score_ratio=... evaluate_s=...``.

Runs without Airflow or Spark (the GPU machine has neither): ``python benchmarks/bench_gpu.py`` with ``jobs`` and
``tests`` on PYTHONPATH, or ``make bench BENCH=gpu``. Environment: BENCH_GPU_PRESET (large on CUDA, small on CPU),
BENCH_GPU_BATCH (8192 / 256), BENCH_GPU_STEPS (400 / 40), BENCH_GPU_ROWS (500000 / 4000), BENCH_GPU_DAYS (2).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
for entry in (REPO / "jobs", REPO / "tests"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from helpers.feature_partitions import write_features  # noqa: E402
from hybridjobs import local_scoring  # noqa: E402
from hybridtrain.config import DEFAULT_MODEL_PRESETS_PATH, load_model_presets, load_run_config  # noqa: E402
from hybridtrain.evaluation import roc_auc  # noqa: E402
from hybridtrain.model import build_network, count_parameters  # noqa: E402
from hybridtrain.preemption import StopRequest  # noqa: E402
from hybridtrain.runner import main as train_main  # noqa: E402
from hybridtrain.runner import prepare_data  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
NOT_MEASURED = "not_measured"


def _setting(name: str, gpu: str, cpu: str) -> str:
    return os.environ.get(f"BENCH_GPU_{name}", gpu if CUDA else cpu)


def _synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reference_training(config, data, steps: int) -> dict:
    """Plain torch on the same split: rows/s of ``steps`` steps after 20 warm-up steps, then the holdout AUC."""
    torch.manual_seed(config.seed)
    model = build_network(len(data.feature_columns), config.model).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01, fused=CUDA)
    x = torch.from_numpy(data.train_x).to(DEVICE)
    y = torch.from_numpy(data.train_y).to(DEVICE)
    batch = config.batch_size
    generator = torch.Generator(device=DEVICE).manual_seed(config.seed)

    def step() -> None:
        rows = torch.randint(0, len(x), (batch,), device=DEVICE, generator=generator)
        with torch.autocast(DEVICE.type, torch.bfloat16, enabled=CUDA):
            logits = model(x[rows]).squeeze(1).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()

    for _ in range(min(20, steps)):
        step()
    _synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize()
    seconds = time.perf_counter() - started
    model.eval()
    with torch.inference_mode():
        holdout = torch.from_numpy(np.ascontiguousarray(data.holdout_x, dtype=np.float32)).to(DEVICE)
        scores = torch.cat([model(holdout[i:i + 65536]).float().cpu() for i in range(0, len(holdout), 65536)])
    return {"rows_per_s": round(steps * batch / seconds, 1), "steps": steps, "seconds": round(seconds, 3),
            "holdout_auc": roc_auc(data.holdout_y, scores.numpy().reshape(-1)),
            "precision": "bf16-autocast" if CUDA else "fp32"}


def write_run_config(path: Path, features: Path, dates: list[str], run_dir: Path, preset: str, batch: int,
                     steps: int, log_every: int | None = None) -> Path:
    path.write_text(json.dumps({
        "run_id": "bench-gpu", "features_root": str(features), "ds": dates, "run_dir": str(run_dir),
        "model": {"preset": preset}, "max_steps": steps, "batch_size": batch, "learning_rate": 0.001,
        "checkpoint_every_steps": steps, "seed": 7, "zero_stage": 0, "precision": "auto",
        "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero0.json"),
        # the loop's timed points (one host sync each): several, so that the warm-up before the first stays out
        "log_every_steps": log_every or max(1, min(50, steps // 8)),
        "gpu_sample_every_s": 0.5,
    }))
    return path


def train(config_path: Path) -> None:
    code = train_main(["--config", str(config_path)], stop=StopRequest())  # no signal handlers of its own
    if code != 0:
        raise RuntimeError(f"jobs/train.py exited {code}; see the log above")


def host_syncs_per_step(workdir: Path, features: Path, dates: list[str], preset: str, batch: int) -> float:
    """The training loop's host synchronizations per step (see the module's docstring)."""
    counts = []
    for steps in (50, 100):
        config = write_run_config(workdir / f"syncs-{steps}.json", features, dates, workdir / f"syncs-{steps}",
                                  preset, batch, steps, log_every=50)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train(config)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(warning.message) for warning in caught))
    return round((counts[1] - counts[0]) / 50, 2)


def reference_scoring(model_path: str, n_features: int, rows: int, precision: str) -> float:
    """rows/s of the exported model on rows already on the device, in ``precision``, 65,536 rows a batch."""
    model = torch.jit.load(model_path, map_location=DEVICE).eval()
    data = torch.randn(rows, n_features, device=DEVICE)
    with torch.inference_mode(), torch.autocast(DEVICE.type, torch.bfloat16, enabled=precision == "bf16"):
        model(data[:65536])
        _synchronize()
        started = time.perf_counter()
        for i in range(0, rows, 65536):
            model(data[i:i + 65536])
        _synchronize()
    return round(rows / (time.perf_counter() - started), 1)


def main() -> dict:
    preset = _setting("PRESET", "large", "small")
    batch, steps = int(_setting("BATCH", "8192", "256")), int(_setting("STEPS", "400", "40"))
    rows, days = int(_setting("ROWS", "500000", "4000")), int(os.environ.get("BENCH_GPU_DAYS", "2"))
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        root = workdir / "storage"
        features = root / "features"
        dates = [f"2026-01-{day:02d}" for day in range(1, days + 1)]
        for seed, ds in enumerate(dates):
            write_features(features, ds, seed, customers=rows)
        run_dir = workdir / "run"
        config_path = write_run_config(workdir / "run.json", features, dates, run_dir, preset, batch, steps)
        config = load_run_config(config_path)
        data = prepare_data(config)
        parameters = count_parameters(build_network(len(data.feature_columns),
                                                    load_model_presets(DEFAULT_MODEL_PRESETS_PATH)[preset]))
        print(f"gpu bench: {torch.cuda.get_device_name(0) if CUDA else 'no CUDA (CPU paths only)'}, torch "
              f"{torch.__version__}, preset {preset} ({parameters} parameters), batch {batch}, {steps} steps, "
              f"{len(data.train_y)} training rows", flush=True)
        reference = reference_training(config, data, steps)
        print(f"reference training: {reference}", flush=True)

        train(config_path)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        model_path = str(run_dir / "export" / "model.pt")
        loop = metrics["loop"]
        suite = {"rows_per_s": loop["rows_per_s"], "step_ms_median": loop["step_ms_median"],
                 "loop_steps": f"{loop['from_step']}-{loop['to_step']}", "holdout_auc": metrics["holdout"]["auc"],
                 "gpu_mean_util_pct": loop["gpu_utilization_pct"], "precision": metrics["deepspeed"]["precision"],
                 "time_split_s": metrics["time_split_s"]}
        print(f"suite training: {suite}", flush=True)

        started = time.perf_counter()
        manifest = local_scoring.run(str(root), dates[0], model_path, "bench")
        scoring = {"rows_per_s": round(rows / (time.perf_counter() - started), 1),
                   "precision": manifest["job"]["precision"], "device": manifest["job"]["device"]}
        scoring["reference_rows_per_s"] = reference_scoring(model_path, len(data.feature_columns), rows,
                                                            scoring["precision"])
        print(f"scoring: {scoring}", flush=True)

        import evaluate  # jobs/evaluate.py

        started = time.perf_counter()
        evaluated = evaluate.evaluate(str(features), tuple(dates), model_path, model_path, config.holdout_fraction)
        evaluation = {"seconds": round(time.perf_counter() - started, 3), "rows": evaluated["holdout_rows"],
                      "device": evaluated["device"], "phases_s": evaluated["phases_s"]}
        print(f"evaluation: {evaluation}", flush=True)
        syncs = host_syncs_per_step(workdir, features, dates, preset, batch) if CUDA else None
        print(f"host syncs per training step: {syncs if CUDA else NOT_MEASURED}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def gpu(value):
        return value if CUDA and value is not None else NOT_MEASURED

    auc_diff = (None if suite["holdout_auc"] is None or reference["holdout_auc"] is None
                else round(abs(suite["holdout_auc"] - reference["holdout_auc"]), 4))
    figures = {
        "device": torch.cuda.get_device_name(0).replace(" ", "_") if CUDA else "cpu",
        "preset": preset, "batch": batch, "steps": steps,
        "train_ref_rows_per_s": gpu(reference["rows_per_s"]), "train_rows_per_s": gpu(suite["rows_per_s"]),
        "train_ratio": gpu(suite["rows_per_s"] and round(suite["rows_per_s"] / reference["rows_per_s"], 3)),
        "train_gpu_util_pct": gpu(suite["gpu_mean_util_pct"]), "train_step_ms": gpu(suite["step_ms_median"]),
        "train_precision": suite["precision"],
        "auc_diff": auc_diff,
        "score_rows_per_s": gpu(scoring["rows_per_s"]), "score_ref_rows_per_s": gpu(scoring["reference_rows_per_s"]),
        "score_ratio": gpu(round(scoring["rows_per_s"] / scoring["reference_rows_per_s"], 3)),
        "score_precision": scoring["precision"], "evaluate_s": gpu(evaluation["seconds"]),
        "train_host_syncs_per_step": gpu(syncs),
    }
    print("RESULT gpu " + " ".join(f"{key}={value}" for key, value in figures.items()), flush=True)
    return {**figures, "reference": reference, "suite": suite, "scoring": scoring, "evaluation": evaluation,
            "torch": torch.__version__, "cpu_figures_only": not CUDA}


if __name__ == "__main__":
    main()
