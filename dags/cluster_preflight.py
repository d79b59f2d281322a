"""
### Cluster preflight: is the interconnect fast enough to train?

Runs `jobs/allreduce_bench.py` as a Slurm job on the GPU partition, one rank per GPU over `nodes` x
`gpus_per_node` (the topology of the training it clears): torch.distributed all-reduce over gradient-sized
buffers (NCCL on GPUs, gloo on CPUs) and one measured training step. Records bus bandwidth, the all-reduce share
of a step and the topology; fails when the share is over the configured limit (20% by default). The nightly
training pipeline refuses to start when the last preflight of its own topology failed, is stale or is missing.
Runbook: `include/runbooks/preflight.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from hybridflow.config import pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.params import integer, strict_params, text
from hybridflow.timetables import cron_schedule

config = pipeline_config()

with DAG(
    dag_id="cluster_preflight",
    schedule=cron_schedule(config.preflight.schedule),  # a missed week is skipped, not run late
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["platform", "gpu", "preflight"],
    doc_md=__doc__,
    params=strict_params({
        "nodes": Param(config.preflight.nodes, **integer(1, 64),
                       description="Nodes, as the training run to clear will use."),
        "gpus_per_node": Param(config.preflight.ranks_per_node, **integer(1, 8),
                               description="GPUs (ranks) per node, as the training run will use; nodes x "
                                           "gpus_per_node must be at least 2."),
        "hidden_sizes": Param("128,64", **text(r"[1-9][0-9]{0,5}(,[1-9][0-9]{0,5}){0,7}"),
                              description="Hidden widths of the model whose gradients are all-reduced, e.g. "
                                          "4096,4096,2048,1024 for the production preset."),
    }),
):
    benchmark = SlurmSubmitOperator(
        task_id="allreduce_benchmark",
        command=[config.cluster.python, f"{config.cluster.jobs_dir}/allreduce_bench.py",
                 "--out", config.storage.layout.preflight_result("{{ params.nodes }}", "{{ params.gpus_per_node }}"),
                 "--hidden-sizes", "{{ params.hidden_sizes }}"],
        partition=config.cluster.partition,
        nodes="{{ params.nodes }}",
        gpus_per_node="{{ params.gpus_per_node }}",
        ranks_per_node="{{ params.gpus_per_node }}",
        cpus_per_task=1,
        time_limit=config.preflight.time_limit_min,
        requeue=False,
        signal=None,
        log_dir=config.storage.layout.run_logs("preflight"),
        ssh_conn_id=config.cluster.ssh_conn_id,
        runbook="include/runbooks/preflight.md",
    )

    @task(retries=0)  # it judges the file the benchmark wrote: a retry would read the same figures
    def allreduce_share_gate(params=None) -> str:
        from hybridflow.pipeline.preflight import check_latest_preflight

        return check_latest_preflight(pipeline_config(), params["nodes"], params["gpus_per_node"])

    benchmark >> allreduce_share_gate()
