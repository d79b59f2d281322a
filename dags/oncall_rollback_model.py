"""
### On-call: roll the realtime model back

One click restores the version of the Triton model that was promoted before the one serving now (or the
version you name), proves it and only then unloads the current one: the target is loaded beside the current
version, must become READY and give its export-time outputs on its smoke set; then the version policy becomes
the target alone. Requests keep being answered throughout. The task's "Model status" link opens the server's
page of the restored version. Then `move_champion` moves the MLflow alias `champion` to the registry version the
restored Triton version serves (its record names it), so batch scoring and the next deploy follow the rollback; a
version deployed outside the pipeline moves nothing, and the task says so. Runbook: `include/runbooks/deploy.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.operators.triton import TritonRollbackOperator, TritonRollbackPlanOperator, serving_kwargs
from hybridflow.params import model_version, strict_params, text
from hybridflow.utils.triton import MODEL_NAME_PATTERN

config = pipeline_config()
serving = config.serving
served = {**serving_kwargs(serving), "model_name": "{{ params.model_name }}"}
PLAN = "{{ ti.xcom_pull(task_ids='plan')"

with DAG(
    dag_id="oncall_rollback_model",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["on-call", "serving", "triton"],
    doc_md=__doc__,
    params=strict_params({
        "model_name": Param(serving.model_name, **text(MODEL_NAME_PATTERN),
                            description="The Triton model to roll back (letters, digits, '_', '.', '-')."),
        "version": Param(0, **model_version(0),
                         description="The version to restore; 0 restores the version promoted before the one "
                                     "serving now."),
    }),
):
    # The target is resolved once, so a retry of the rollback cannot walk back one version more.
    plan = TritonRollbackPlanOperator(task_id="plan", **served, version="{{ params.version }}")
    rollback = TritonRollbackOperator(task_id="rollback", **served, version=PLAN + "['version'] }}",
                                      from_version=PLAN + "['from_version'] }}")

    @task
    def move_champion(rolled: dict, run_id=None) -> str:
        from hybridflow.pipeline.nightly_tasks import model_registry

        moved = model_registry(config).record_triton_rollback(rolled, holder=run_id)
        print(moved)
        return moved

    plan >> rollback
    move_champion(rollback.output)
