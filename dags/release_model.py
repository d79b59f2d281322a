"""
### Release a published model version, with a person's approval

Releases a version already in the model repository (one rolled back earlier, or published by a run whose
deploy was skipped) the way the nightly deploys: loaded beside the serving version, smoke set, latency gate, then
real traffic through the guard (shadow, each canary share, every step judged on error rate, p99, mean score shift
and PSI against the serving version; `serving.release` in the pipeline config).

With `approval=ask` (default) the release then stops at its last canary step and **Required actions** asks a
person, with every step's figures: **Promote** (the new version alone serves, the old one is unloaded) or **Roll
back** (the old version alone serves again). Nobody answering within `serving.release.approval_timeout_s` rolls
back and fails the run, so on-call hears of it. `approval=auto` promotes when every step passes. The nightly DAG
asks the same way with `deploy=ask`. Runbook: `include/runbooks/deploy.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.operators.triton import APPROVALS, TritonDeployOperator, approval_tasks, deploy_kwargs
from hybridflow.params import model_version, strict_params, text
from hybridflow.utils.triton import MODEL_NAME_PATTERN

serving = pipeline_config().serving

with DAG(
    dag_id="release_model",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["serving", "triton", "on-call"],
    doc_md=__doc__,
    params=strict_params({
        "model_name": Param(serving.model_name, **text(MODEL_NAME_PATTERN),
                            description="The Triton model (letters, digits, '_', '.', '-')."),
        "version": Param(**model_version(1),
                         description="The published version to release (its folder in the model repository)."),
        "approval": Param("ask", type="string", enum=list(APPROVALS),
                          description="ask: a person promotes or rolls back after the canary steps; auto: promote "
                                      "when every step passes."),
    }),
):
    deploy = TritonDeployOperator(
        task_id="deploy_model",
        version="{{ params.version }}",
        approval="{{ params.approval }}",
        **{**deploy_kwargs(serving), "model_name": "{{ params.model_name }}"},
        pool="triton_deploy",
    )
    approval_tasks(deploy, serving.release)
