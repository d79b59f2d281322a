"""What the workload router's tasks do, kept out of the DAG file: route a spec from the trigger form and say what
runs on which side. The rules themselves live in routing.py."""

from __future__ import annotations

from typing import Any

from hybridflow.config import PipelineConfig
from hybridflow.exceptions import HybridflowError, WorkloadSpecError
from hybridflow.paths import jobs_dir
from hybridflow.pipeline.nightly_tasks import model_of_record
from hybridflow.pipeline.routing import (
    RoutingRules,
    WorkloadSpec,
    plan_job,
    preset_router,
    route,
    triton_deploy_plan,
)

RUNBOOK = "include/runbooks/workload-router.md"
# The task run for each side a workload can be routed to.
BRANCHES = {"spark": "run_on_cpu_spark", "slurm_gpu": "run_on_gpu_slurm", "slurm_cpu": "run_on_cpu_slurm",
            "triton": "serve_on_triton"}


def route_workload(config: PipelineConfig, rules: RoutingRules, params: dict[str, Any], run_id: str) -> dict:
    """The route task: the decision, and the job or deployment it stands for, as XCom values the side's task
    reads. A refused spec, or a deploy with no model of record, fails at once: a retry cannot change either."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        decision = route(WorkloadSpec.from_params(params), rules, preset_router(config))
    except WorkloadSpecError as exc:
        raise AirflowFailException(f"workload refused: {exc}. Runbook: {RUNBOOK}") from exc
    run_dir = config.storage.layout.router_run_dir(run_id)
    job = plan_job(decision, rules, {
        "storage_root": lambda: config.storage.root,
        "run_dir": lambda: run_dir,
        "cluster_python": lambda: config.cluster.python,
        "cluster_jobs_dir": lambda: config.cluster.jobs_dir,
        "model_path": lambda: model_of_record(config)["model_path"],
        "model_version": lambda: model_of_record(config)["version"],
    })
    deploy = None
    if decision.target == "triton":
        try:
            deploy = triton_deploy_plan(decision, model_of_record(config), config.serving)
        except HybridflowError as exc:
            raise AirflowFailException(f"{exc}. Runbook: {RUNBOOK}") from exc
    print(f"Routing decision: {decision.reason} (rule: {decision.rule}); "
          f"{'deployment: ' + deploy['summary'] if deploy else f'job: {job}'}")
    return {
        "decision": decision.as_dict(),
        "deploy": deploy,
        "triton_export_dir": deploy["export_dir"] if deploy else None,
        "run_dir": run_dir,
        "spark_application": str(jobs_dir() / job.application) if job and job.application else None,
        "spark_args": list(job.args) if job else [],
        "slurm_command": list(job.command) if job else [],
    }


def choose_side(decision: dict, deploy: dict | None, dry_run: bool) -> str | None:
    """The branch of the routed side, or none in a dry run, which says what it would have run."""
    branch = BRANCHES[decision["target"]]
    if dry_run:
        what = f": {deploy['summary']}" if deploy else ""
        print(f"dry run: {decision['reason']}; would run {branch}{what}; runs nothing")
        return None
    return branch
