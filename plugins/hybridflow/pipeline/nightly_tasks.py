"""What the nightly pipeline's Python tasks do, kept out of the DAG file: each function reads or writes the
shared storage or the cluster and returns a small JSON-able dict for XCom. Decisions live in nightly.py
and champion.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hybridflow.config import PipelineConfig, model_preset_names
from hybridflow.exceptions import HybridflowError
from hybridflow.paths import jobs_dir
from hybridflow.pipeline import nightly, quality
from hybridflow.pipeline.registry import ModelRegistry
from hybridflow.utils.slurm_jobs import generation, generation_run_dir


def simulate_raw_events(config: PipelineConfig, ds: str) -> str:
    """The local stand-in for the upstream producer: the deterministic generator, once per ds."""
    command = [sys.executable, str(jobs_dir() / "generate_raw.py"), "--root", config.storage.root, "--ds", ds,
               "--rows", str(config.nightly.simulate_raw_rows), "--skip-if-published"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise HybridflowError(f"the raw event generator exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def raw_is_published(config: PipelineConfig, ds: str) -> bool:
    return (Path(config.storage.layout.partition("raw", ds)) / "_SUCCESS").is_file()


def quality_gate(config: PipelineConfig, ds: str) -> dict[str, Any]:
    """The data quality gate on features/ds=<ds> against the previous published partition."""
    layout = config.storage.layout
    manifest = quality.load_manifest(layout.partition("features", ds))
    before = quality.previous_ds(quality.published_ds(layout.dataset("features")), ds)
    previous = quality.load_manifest(layout.partition("features", before)) if before else None
    results = quality.gate(manifest, previous, quality.load_contract())
    return {"summary": quality.summary(results), "compared_with": before,
            "checks": [r.as_dict() for r in results],
            "figures": nightly.features_figures(manifest, config.spark.executor_cores)}


def prepare_training(config: PipelineConfig, ds: str, run_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """The run directory, the training window and the run config the job reads; the champion to beat."""
    presets = model_preset_names()
    if params["model_preset"] not in presets:
        raise HybridflowError(f"param model_preset={params['model_preset']!r}: choose one of {sorted(presets)}")
    window = nightly.training_window(ds, params["train_window_days"],
                                     quality.published_ds(config.storage.layout.dataset("features")))
    # retrain=N: generation N's own fresh run directory (the train and evaluate job names carry N too)
    retrain = generation(params.get("retrain", 0))
    run_dir = generation_run_dir(config.storage.layout.training_run_dir(ds, run_id), retrain)
    code = Path(config.cluster.jobs_dir).parent
    cfg = config.nightly
    run_config = {
        "run_id": run_id,
        "labels": {"dag_id": "nightly_training", "ds": ds, "retrain": retrain},
        "features_root": config.storage.layout.dataset("features"),
        "ds": window,
        "model": {"preset": params["model_preset"]},
        "epochs": params["epochs"],
        "max_steps": params["max_steps"],
        "batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
        "checkpoint_every_steps": cfg.checkpoint_every_steps,
        "keep_last_checkpoints": 3,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "seed": 42,
        "zero_stage": cfg.zero_stage,
        "deepspeed_config": f"{code}/include/deepspeed/zero{cfg.zero_stage}.json",
        "torch_threads": cfg.torch_threads,
    }
    champion = ModelRegistry(config.storage.root, cfg.model_name).champion()
    return {
        "run_dir": run_dir,
        "run_config": run_config,
        "train_ds": ",".join(window),
        "champion_model": champion["model_path"] if champion else "",
        "champion_version": champion["version"] if champion else None,
    }


def read_cluster_json(config: PipelineConfig, path: str) -> dict[str, Any] | None:
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook(config.cluster.ssh_conn_id)
    try:
        text = hook.read_text(path)
    finally:
        hook.close()
    return json.loads(text) if text else None


def decide_and_publish(config: PipelineConfig, prepared: dict[str, Any], ds: str, run_id: str) -> dict[str, Any]:
    """Champion/challenger on the evaluation job's result; a winning challenger becomes the model of record."""
    from hybridflow.pipeline.champion import decide

    run_dir = prepared["run_dir"]
    evaluation = read_cluster_json(config, f"{run_dir}/evaluation.json")
    if evaluation is None:
        raise HybridflowError(f"{run_dir}/evaluation.json is missing: the evaluation job did not write it; "
                              "see its log (runbook: include/runbooks/evaluation.md)")
    decision = decide(evaluation, config.nightly.min_auc_gain, prepared["champion_version"])
    result = {**decision.as_dict(), "holdout_rows": evaluation.get("holdout_rows"), "promoted_version": None}
    if decision.promotes:
        record = ModelRegistry(config.storage.root, config.nightly.model_name).promote(
            f"{run_dir}/export",
            {"run_id": run_id, "ds": ds, "train_ds": prepared["train_ds"], "auc": decision.challenger["auc"],
             "log_loss": decision.challenger["log_loss"], "decision": decision.decision, "reason": decision.reason},
        )
        result["promoted_version"] = record["version"]
    return result


def model_of_record(config: PipelineConfig) -> dict[str, Any]:
    champion = ModelRegistry(config.storage.root, config.nightly.model_name).champion()
    if champion is None:
        raise HybridflowError(
            f"no model of record for {config.nightly.model_name!r} yet: trigger nightly_training with train=always "
            "for a recent date first (runbook: include/runbooks/scoring.md)")
    return {"model_path": champion["model_path"], "version": f"v{champion['version']}",
            "export_dir": champion["export_dir"], "number": champion["version"]}


def scoring_figures(config: PipelineConfig, ds: str) -> dict[str, Any] | None:
    path = Path(config.storage.layout.partition("predictions", ds)) / "_MANIFEST.json"
    manifest = json.loads(path.read_text()) if path.is_file() else None
    return nightly.scoring_figures(manifest, config.spark.executor_cores)
