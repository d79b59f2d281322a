"""What the nightly pipeline's Python tasks do, kept out of the DAG file: each function reads or writes the
shared storage or the cluster and returns a small JSON-able dict for XCom. Decisions live in nightly.py
and champion.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hybridflow.config import PipelineConfig, model_preset_hidden_sizes, model_preset_names
from hybridflow.exceptions import HybridflowError
from hybridflow.hooks.storage_root import StorageRoot
from hybridflow.layout import SIGNATURE_FILE, TrainingRunDir
from hybridflow.paths import jobs_dir
from hybridflow.pipeline import nightly, placement, quality
from hybridflow.pipeline.registry import ModelRegistry
from hybridflow.utils.slurm_jobs import generation


def plan(config: PipelineConfig, run_type: str, params: dict[str, Any], ds: str) -> nightly.RunPlan:
    """What the run does (nightly.plan_run) and where it trains: CPU or GPU for its preset (placement), decided
    once here; the capacity gate and the train task read the partition and GPUs per node from this plan."""
    cfg = config.nightly
    where = placement.training_placement(
        params.get("model_preset", cfg.model_preset), params.get("device", cfg.device),
        params.get("gpus_per_node", cfg.gpus_per_node),
        placement=config.placement, costs=config.costs, cpus_per_task=cfg.cpus_per_task,
        gpu_partition=config.cluster.partition)
    return nightly.plan_run(run_type, params, ds, placement=where.as_dict())


def simulate_raw_events(config: PipelineConfig, ds: str) -> str:
    """The local stand-in for the upstream producer: the deterministic generator, once per ds."""
    command = [sys.executable, str(jobs_dir() / "generate_raw.py"), "--root", config.storage.root, "--ds", ds,
               "--rows", str(config.nightly.simulate_raw_rows), "--skip-if-published"]
    env = {**os.environ, **storage_root(config).job_environment()}  # keys in its environment, not its argv
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise HybridflowError(f"the raw event generator exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def storage_root(config: PipelineConfig) -> StorageRoot:
    return StorageRoot(config.storage.root, config.storage.conn_id)


def raw_is_published(config: PipelineConfig, ds: str) -> bool:
    return storage_root(config).is_published("raw", ds)


def quality_gate(config: PipelineConfig, ds: str) -> dict[str, Any]:
    """The data quality gate on features/ds=<ds> against the previous published partition."""
    store = storage_root(config)
    manifest = quality.require_published(store.manifest("features", ds), store.layout.partition("features", ds))
    published = store.published_manifests("features")
    before = quality.previous_ds(published, ds)
    previous = published[before] if before else None
    results = quality.gate(manifest, previous, quality.load_contract())
    return {"summary": quality.summary(results), "compared_with": before,
            "checks": [r.as_dict() for r in results],
            "figures": nightly.features_figures(manifest, config.spark.executor_cores)}


def prepare_training(config: PipelineConfig, ds: str, run_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """The run directory, the training window and the run config the job reads; the champion to beat."""
    presets = model_preset_names()
    if params["model_preset"] not in presets:
        raise HybridflowError(f"param model_preset={params['model_preset']!r}: choose one of {sorted(presets)}")
    published = storage_root(config).published_manifests("features")
    window = nightly.training_window(ds, params["train_window_days"], published)
    # retrain=N: generation N's own fresh run directory (the train and evaluate job names carry N too)
    retrain = generation(params.get("retrain", 0))
    run_dir = config.storage.layout.training_run(ds, run_id).for_generation(retrain).root
    code = Path(config.cluster.jobs_dir).parent
    cfg = config.nightly
    zero_stage, strategy = nightly.zero_stage_for(cfg.zero_stage, int(params.get("nodes", cfg.nodes)),
                                                  cfg.zero_stage_one_node, cfg.zero_stage_several_nodes)
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
        "zero_stage": zero_stage,
        "deepspeed_config": f"{code}/include/deepspeed/zero{zero_stage}.json",
        "torch_threads": cfg.torch_threads,
    }
    champion = model_registry(config).champion()
    evaluation = evaluation_placement(config, params, [published[d] for d in window], champion)
    return {
        "run_dir": run_dir,
        "run_config": run_config,
        "train_ds": ",".join(window),
        "champion_model": champion["model_path"] if champion else "",
        "champion_version": champion["version"] if champion else None,
        # where the evaluation job runs (the evaluate task's partition and GPUs), and why
        "eval_partition": evaluation.partition,
        "eval_gpus": evaluation.gpus_per_node,
        "evaluation_placement": evaluation.as_dict(),
        "training_strategy": strategy,
    }


def evaluation_placement(config: PipelineConfig, params: dict[str, Any], window: list[dict[str, Any]],
                         champion: dict[str, Any] | None) -> placement.EvaluationPlacement:
    """CPU or GPU for the evaluation job: the challenger's parameters from its preset, the champion's from its
    export's signature.json (written by the training job), the holdout's size from the window's manifests."""
    n_features = len(quality.load_contract().feature_columns)
    challenger = placement.mlp_parameters(n_features, model_preset_hidden_sizes()[params["model_preset"]])
    counts = [manifest.get("row_count") for manifest in window]
    rows = placement.holdout_rows(counts, config.placement.evaluation.holdout_fraction)
    return placement.evaluation_placement(
        challenger, champion_parameters(champion), rows, config=config.placement.evaluation,
        cpu_partition=config.placement.cpu_partition, gpu_partition=config.cluster.partition,
        device=params.get("device", config.nightly.device))


def champion_parameters(champion: dict[str, Any] | None) -> int | None:
    """0 without a champion; its parameters as its export recorded them; None when not recorded."""
    if champion is None:
        return 0
    model = _read_json(Path(champion["export_dir"]) / SIGNATURE_FILE).get("model")
    count = model.get("n_parameters") if isinstance(model, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_cluster_json(config: PipelineConfig, path: str) -> dict[str, Any] | None:
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook(config.cluster.ssh_conn_id)
    try:
        text = hook.read_text(path)
    finally:
        hook.close()
    return json.loads(text) if text else None


def model_registry(config: PipelineConfig) -> ModelRegistry:
    """The registry of ``nightly.model_name`` on the MLflow server of connection ``mlflow_default``."""
    from hybridflow.hooks.mlflow import MlflowHook

    return ModelRegistry(MlflowHook(), config.storage.root, config.nightly.model_name)


def decide_and_publish(config: PipelineConfig, prepared: dict[str, Any], ds: str, run_id: str) -> dict[str, Any]:
    """Champion/challenger on the evaluation job's result. The trained model becomes a registry version (alias
    challenger) with the decision and its reason in tags; a winning challenger then takes the champion alias,
    if the champion is still the one it was compared with."""
    from hybridflow.pipeline.champion import CHAMPION_MOVED, decide
    from hybridflow.utils.mlflow_tracking import stored_run_id

    run = TrainingRunDir(prepared["run_dir"])
    evaluation = read_cluster_json(config, run.evaluation)
    if evaluation is None:
        raise HybridflowError(f"{run.evaluation} is missing: the evaluation job did not write it; "
                              "see its log (runbook: include/runbooks/evaluation.md)")
    tracking = read_cluster_json(config, run.mlflow_run)
    training_run = stored_run_id(json.dumps(tracking)) if tracking else None
    if training_run is None:
        raise HybridflowError(f"{run.mlflow_run} names no MLflow run: the training task logs its run when it "
                              "ends; clear it (it follows its finished job, it does not train again) and retry")
    decision = decide(evaluation, config.nightly.min_auc_gain, prepared["champion_version"])
    registry = model_registry(config)
    record = registry.register(run.export, run_id=training_run, details={
        "airflow_run_id": run_id, "ds": ds, "train_ds": prepared["train_ds"], "auc": decision.challenger["auc"],
        "log_loss": decision.challenger["log_loss"], "decision": decision.decision, "reason": decision.reason})
    result = {**decision.as_dict(), "holdout_rows": evaluation.get("holdout_rows"), "promoted_version": None,
              "registered_version": record["version"], "mlflow_run_id": training_run,
              "model_uri": f"models:/{registry.model_name}/{record['version']}"}
    if decision.promotes:
        outcome = registry.promote(record["version"], expected_champion=prepared["champion_version"],
                                   reason=decision.reason, holder=run_id)
        if outcome.promoted:
            result["promoted_version"] = record["version"]
        else:
            result.update(decision=CHAMPION_MOVED, reason=outcome.message)
    return result


def model_of_record(config: PipelineConfig) -> dict[str, Any]:
    registry = model_registry(config)
    champion = registry.champion()
    if champion is None:
        raise HybridflowError(
            f"no model of record for {config.nightly.model_name!r} yet (MLflow alias {registry.champion_uri} is "
            "not set): trigger nightly_training with train=always for a recent date first (runbook: "
            "include/runbooks/scoring.md)")
    return {"model_path": champion["model_path"], "version": f"v{champion['version']}",
            "export_dir": champion["export_dir"], "number": champion["version"], "uri": registry.champion_uri,
            "version_uri": f"models:/{registry.model_name}/{champion['version']}", "run_id": champion["run_id"]}


def record_in_registry(config: PipelineConfig, model: dict[str, Any] | None, deployed: dict[str, Any] | None,
                       ds: str, run_id: str) -> dict[str, Any]:
    """Tag the model of record's registry version with what this run did with it: the partition it scored and the
    Triton version the deploy served or rolled back (``deployed``, the deploy's report, None when it did not run)."""
    if not model:
        return {"recorded": False, "reason": "no model of record this run: nothing to record"}
    registry = model_registry(config)
    recorded: dict[str, Any] = {"recorded": True, "version_uri": model.get("version_uri")}
    figures = scoring_figures(config, ds)
    if figures and figures.get("model_version") == model["version"]:
        recorded["scoring"] = registry.record_scoring(model["number"], ds, figures.get("rows"), run_id)
    if deployed and deployed.get("model_uri") == model.get("version_uri"):
        recorded["deploy"] = registry.record_deploy(model["number"], deployed)
    return recorded


def scoring_figures(config: PipelineConfig, ds: str) -> dict[str, Any] | None:
    manifest = storage_root(config).manifest("predictions", ds)
    return nightly.scoring_figures(manifest, config.spark.executor_cores)


def plan_deploy(config: PipelineConfig, run_plan: dict, model: dict, decision: dict) -> tuple[bool, str]:
    """Whether the run deploys the model of record, and why: the plan's deploy mode, the evaluation's decision
    (``decision``: champion_challenger's result, empty when the run did not evaluate) and what Triton serves."""
    from hybridflow.hooks.triton import TritonHook

    serving = TritonHook(config.serving.triton_conn_id).ready_versions(config.serving.model_name)
    return nightly.should_deploy(run_plan["deploy_mode"], decision.get("promoted_version"), model["number"], serving)
