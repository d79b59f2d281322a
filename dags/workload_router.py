"""
### Workload router

Takes a workload spec from the trigger form (`workload_type`, its `config`, optionally a measured `profile`)
and routes it to the CPU or GPU side by the rules in `include/config/routing.yaml`, the way a hybrid scheduler
does: ETL, features and batch scoring run on CPUs (Spark, or the Slurm `cpu` partition); training and
low-latency inference on GPUs (the `gpu-training` partition, Triton). A measured profile can move a workload:
a large batch measured much faster on a GPU goes there, a model too small to use a GPU does not, realtime
serving stays on CPU while CPU p99 meets the latency budget. Training that names a model `preset` (and no
deciding profile) goes where nightly_training's placement rule sends that preset (measured rows/s and cost per
1,000 rows in pipeline.yaml `placement`: the small preset trains on the `cpu` partition). ETL never goes to GPUs.

- `route` validates the spec against the rules and logs the decision and why; an unknown type, config field
  or profile figure is refused with what is accepted.
- Then one of: `run_on_cpu_spark` (spark-submit of the job the rules name), `run_on_gpu_slurm` (one GPU on
  the training partition), `run_on_cpu_slurm` (the `cpu` partition), `serve_on_triton` (deploys the model of
  record through the deploy operator: publish, load beside the serving version, smoke test, latency gate,
  promote or roll back). Commands come from the rules; config values only fill their whitelisted, validated
  fields.
- `dry_run=true` routes, logs exactly what it would run (the job's argv, or the deployment) and runs nothing.

On-call: trigger it with `dry_run` to see where a workload would go and why, or to run one on its side by
hand. Runbook: `include/runbooks/workload-router.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS, spark_submit_defaults
from hybridflow.layout import LOGS_DIR
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.operators.spark import StorageSparkSubmitOperator
from hybridflow.operators.triton import TritonDeployOperator, deploy_kwargs
from hybridflow.params import closed_object, number, strict_params, workload_config
from hybridflow.pipeline.router_tasks import BRANCHES, RUNBOOK
from hybridflow.pipeline.routing import PROFILE_METRICS, routing_rules

config = pipeline_config()
rules = routing_rules()
CONFIG_FIELDS = "; ".join(
    f"{name}: {', '.join(f.describe() for f in workload.fields.values()) or 'none'}"
    for name, workload in rules.workloads.items())
MAX_FIGURE = 1e12  # rows, ms, FLOPs per byte or a speedup: a larger figure is a typo (and 1e400 is infinity)

with DAG(
    dag_id="workload_router",
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["router", "cpu", "gpu", "spark", "on-call"],
    doc_md=__doc__,
    params=strict_params({
        "workload_type": Param(
            rules.workload_types[0], type="string", enum=list(rules.workload_types),
            maxLength=64,  # bounds the value even where the enum is bypassed (the route task then refuses it)
            values_display={name: f"{name}: {w.description}" for name, w in rules.workloads.items()},
            description="What kind of work this is; include/config/routing.yaml routes each type to a side."),
        "config": Param({}, **workload_config(rules.workloads.values()),
                        description="Settings of the workload; only these fields are accepted. "
                                    + CONFIG_FIELDS),
        "profile": Param({}, **closed_object({m: number(0, MAX_FIGURE, description=d)
                                              for m, d in PROFILE_METRICS.items()}),
                         description="Optional measured figures that can move the workload to the other "
                                     "side: " + "; ".join(f"{m}: {d}" for m, d in PROFILE_METRICS.items())),
        "dry_run": Param(False, type="boolean", description="Route and log the decision; run nothing."),
    }),
):

    @task(multiple_outputs=True)
    def route(params=None, run_id=None) -> dict:
        from hybridflow.pipeline.router_tasks import route_workload

        return route_workload(config, rules, params, run_id)

    @task.branch
    def choose_side(decision: dict, deploy: dict | None, params=None) -> str | None:
        from hybridflow.pipeline.router_tasks import choose_side

        return choose_side(decision, deploy, params["dry_run"])

    routed = route()
    chosen = choose_side(routed["decision"], routed["deploy"])

    run_on_cpu_spark = StorageSparkSubmitOperator(
        task_id="run_on_cpu_spark",
        **spark_submit_defaults(),
        application=routed["spark_application"],
        application_args=routed["spark_args"],
        name="workload-router",
        doc_md=f"Runbook: {RUNBOOK}, then include/runbooks/features.md",
    )

    @task
    def slurm_argv(command: list[str]) -> list[list[str]]:
        """The routed Slurm command as the one item the Slurm tasks map over (none when routed elsewhere)."""
        return [command] if command else []

    # Mapped because the operator takes its argv as a list when the DAG is built, and the argv's length
    # depends on the workload; mapped values reach the operator as data, never rendered as templates.
    slurm_kwargs = {"log_dir": "{{ ti.xcom_pull(task_ids='route', key='run_dir') }}/" + LOGS_DIR,
                    "ssh_conn_id": config.cluster.ssh_conn_id, "requeue": False, "signal": None,
                    "poll_interval_s": 3, "runbook": RUNBOOK}
    slurm_commands = slurm_argv(routed["slurm_command"])
    slurm_jobs = {
        target: SlurmSubmitOperator.partial(
            task_id=BRANCHES[target], partition=rules.slurm[target].partition,
            gpus_per_node=rules.slurm[target].gpus_per_node, cpus_per_task=rules.slurm[target].cpus_per_task,
            time_limit=rules.slurm[target].time_limit_min, **slurm_kwargs,
        ).expand(command=slurm_commands)
        for target in ("slurm_gpu", "slurm_cpu")
    }

    serve_on_triton = TritonDeployOperator(
        task_id="serve_on_triton",
        export_dir="{{ ti.xcom_pull(task_ids='route', key='triton_export_dir') }}",
        **deploy_kwargs(config.serving),
        pool="triton_deploy",
        doc_md=f"Runbook: {RUNBOOK}, then include/runbooks/deploy.md",
    )

    chosen >> [run_on_cpu_spark, *slurm_jobs.values(), serve_on_triton]
