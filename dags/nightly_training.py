"""
### Nightly training pipeline

One day's data through the whole estate: raw events -> **features** (Spark) -> **quality** gate -> **capacity**
gate (`nodes` x `gpus_per_node` free) -> **training** (DeepSpeed on the Slurm GPU partition, one rank per GPU
launched by `srun`, deferrable, resumable; or on the CPU partition, see `device`) -> **checkpoint** gate ->
**evaluation** (challenger vs the model of record on the same holdout; promote only when better by the configured
margin) -> **scoring** (Spark, with the model of record)
-> **deploy** (Triton: readiness, smoke test, latency gate, promote or roll back) -> **report** (HTML + JSON:
volumes, quality, loss curve, ranks, all-reduce share, GPU-hours, utilization, cost, latency), and the model of
record's MLflow registry version tagged with what it scored and the Triton version that serves it.

- Scheduled nightly; reruns of a date replace its outputs, never duplicate them.
- Backfills (`airflow backfill create` or the UI) recompute features and re-score history with the model of record;
  they train or deploy only with `train=always` / `deploy=always`. Pools `spark` and `gpu_training` keep a
  backfill from flooding Spark or the GPU partition.
- `device`: `auto` trains on the CPU partition when the preset's measured figures say a GPU does not pay off
  (`placement` in include/config/pipeline.yaml: the small preset does not take a GPU), else on the GPU partition;
  `gpu` / `cpu` ask for a side. The plan task logs the decision with its figures; the report shows it.
- `dry_run=true` plans the run (what would train, on which partitions) and runs nothing.

Runbooks: `include/runbooks/<stage>.md` for each stage (features, data-quality, capacity, training, evaluation,
scoring, deploy, report, backfill).
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Asset, Param, TaskGroup, task
from hybridflow.config import DEPLOY_MODES, DEVICES, model_preset_names, pipeline_config
from hybridflow.dag_defaults import DEFAULT_ARGS, run_deadline, spark_submit_defaults
from hybridflow.layout import TrainingRunDir, asset_uri
from hybridflow.operators.report import RunReportOperator
from hybridflow.operators.spark import StorageSparkSubmitOperator
from hybridflow.operators.training import DeepSpeedTrainingOperator, GenerationSlurmSubmitOperator
from hybridflow.operators.triton import TritonDeployOperator, approval_tasks, deploy_kwargs
from hybridflow.params import integer, stall_watch, strict_params
from hybridflow.paths import jobs_dir
from hybridflow.pipeline.nightly import NightlyTask
from hybridflow.sensors.checkpoint import CheckpointSensor
from hybridflow.sensors.slurm import SlurmCapacitySensor
from hybridflow.timetables import cron_schedule
from hybridflow.utils.slurm_jobs import MAX_GENERATION

config = pipeline_config()
cfg, root, cluster = config.nightly, config.storage.root, config.cluster
layout = config.storage.layout
FEATURES = Asset(name="hybridflow_features", uri=asset_uri(layout.dataset("features")))
MODEL = Asset(name="hybridflow_model_of_record", uri=asset_uri(layout.model_dir(cfg.model_name)))
PREDICTIONS = Asset(name="hybridflow_predictions", uri=asset_uri(layout.dataset("predictions")))


def prepared_value(key: str) -> str:
    """A template for one field of training.prepare's result (a dict field renders as JSON)."""
    rendered = "| tojson " if key == "run_config" else ""
    return "{{ ti.xcom_pull(task_ids='" + NightlyTask.PREPARE + "')['" + key + "'] " + rendered + "}}"


MODEL_OF_RECORD = "{{ ti.xcom_pull(task_ids='" + NightlyTask.MODEL_OF_RECORD + "')"  # a template's start


# The run directory prepare chose (its generation's), as a template: a member only appends its name, so it renders
# to that member of the rendered directory.
PREPARED_RUN = TrainingRunDir(prepared_value("run_dir"))


def planned_placement(key: str, before: str) -> str:
    """A template for one field of the plan's training placement (CPU or GPU). A run planned before placement
    existed (one of its tasks cleared after an upgrade) renders ``before``, a Jinja expression: its GPU job."""
    plan = "(ti.xcom_pull(task_ids='" + NightlyTask.PLAN + "') or {})"
    return "{{ (" + plan + ".get('placement') or {}).get('" + key + "', " + before + ") }}"


def prepared_or(key: str, before: str) -> str:
    """A template for one field of training.prepare's result, ``before`` (Jinja) where an older prepare lacks it."""
    return "{{ ti.xcom_pull(task_ids='" + NightlyTask.PREPARE + "').get('" + key + "', " + before + ") }}"


with DAG(
    dag_id="nightly_training",
    # A night that has passed is never started late (a backfill or an unpause would otherwise start last night at
    # once): NoMissedRunCronTimetable, see hybridflow/timetables.py. Backfills cover the past on request.
    schedule=cron_schedule(cfg.cron),
    catchup=False,
    max_active_runs=cfg.max_active_runs,
    default_args=DEFAULT_ARGS,
    tags=["pipeline", "training", "gpu", "spark", "serving"],
    deadline=run_deadline(cfg.deadline_min * 60),
    doc_md=__doc__,
    params=strict_params({
        "train": Param("auto", type="string", enum=["auto", "always", "never"],
                       description="auto: train on scheduled and manual runs, not in backfills; always; never."),
        "deploy": Param(cfg.deploy, type="string", enum=list(DEPLOY_MODES),
                        description="auto: deploy when this run promotes a model or the server lacks the model of "
                                    "record (never in backfills); always: redeploy the model of record; never; "
                                    "ask: as auto, and after the canary steps a person promotes or rolls back "
                                    "(Required actions; roll back when nobody answers in time)."),
        "model_preset": Param(cfg.model_preset, type="string", enum=list(model_preset_names()),
                              description="Network size from include/config/model_presets.json."),
        "nodes": Param(cfg.nodes, **integer(1, 64),
                       description="Nodes for the training job (data-parallel across nodes)."),
        "gpus_per_node": Param(cfg.gpus_per_node, **integer(1, 8),
                               description="GPUs per node; one DeepSpeed rank per GPU (nodes x gpus_per_node ranks in "
                                           "all). On the "
                                  "CPU partition: as many CPU processes per node."),
        "device": Param(cfg.device, type="string", enum=list(DEVICES),
                        description="auto: CPU or GPU by the preset's measured throughput and cost per 1,000 rows "
                                    "(pipeline.yaml placement; the small preset trains on the CPU partition); "
                                    "gpu: the GPU partition; cpu: the CPU partition, no GPU."),
        "epochs": Param(cfg.epochs, **integer(1, 100),
                        description="Training epochs over the window (max_steps ends training earlier)."),
        "max_steps": Param(cfg.max_steps, **integer(1, 1_000_000),
                           description="Upper bound on optimizer steps."),
        "train_window_days": Param(cfg.train_window_days, **integer(1, 90),
                                   description="Days of published features, ending at the run's date, to train on."),
        **stall_watch(config.recovery),
        "retrain": Param(0, **integer(0, MAX_GENERATION),
                         description="Training generation. 0: a cleared or rerun training task follows the job this "
                                     "run already ran, even a completed one (never twice). N: a new job and a fresh "
                                     "run directory for generation N of this run (each at most once), e.g. to "
                                     "retrain after fixing data; earlier generations' outputs stay."),
        "dry_run": Param(False, type="boolean", description="Plan the run and log it; run nothing."),
    }),
) as dag:

    @task(retries=0)  # a decision from params and config: a retry would decide the same
    def plan(params=None, dag_run=None, ds=None) -> dict:
        from hybridflow.pipeline.nightly_tasks import plan as plan_nightly

        decided = plan_nightly(config, dag_run.run_type, params, ds)
        print(f"Plan for ds={ds}: {decided.reason}; train={decided.train}, deploy={decided.deploy_mode}")
        print(f"Placement: {decided.placement['reason']}")
        if decided.dry_run:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(f"dry run: {decided.as_dict()}")
        return decided.as_dict()

    with TaskGroup("preflight", tooltip="raw data present; interconnect fit for training") as preflight:

        @task
        def simulate_raw_events(ds=None) -> str:
            from airflow.sdk.exceptions import AirflowSkipException
            from hybridflow.pipeline.nightly_tasks import simulate_raw_events

            if not config.nightly.simulate_raw:
                raise AirflowSkipException("raw events come from upstream (nightly.simulate_raw is off)")
            return simulate_raw_events(config, ds)

        @task.sensor(poke_interval=60, timeout=cfg.raw_wait_timeout_min * 60, mode="reschedule",
                     trigger_rule="none_failed_min_one_success")
        def raw_events_published(ds=None) -> bool:
            from hybridflow.pipeline.nightly_tasks import raw_is_published

            return raw_is_published(config, ds)

        @task(retries=0)  # judges the last preflight's figures; rerun cluster_preflight instead
        def allreduce_preflight(run_plan: dict, params=None) -> str:
            from airflow.sdk.exceptions import AirflowSkipException
            from hybridflow.pipeline.preflight import check_latest_preflight

            if not run_plan["train"]:
                raise AirflowSkipException("this run does not train")
            side = (run_plan.get("placement") or {}).get("side", "gpu")  # a run planned before placement: GPU
            return check_latest_preflight(config, params["nodes"], params["gpus_per_node"], side)

        run_plan = plan()
        raw_ready = raw_events_published()
        run_plan >> simulate_raw_events() >> raw_ready
        run_plan >> raw_ready
        preflight_ok = allreduce_preflight(run_plan)

    with TaskGroup("features", tooltip="Spark: raw events -> per-customer features, quarantine") as features:
        build_features = StorageSparkSubmitOperator(
            task_id="build_features",
            **spark_submit_defaults(),
            application=str(jobs_dir() / "build_features.py"),
            application_args=["--root", root, "--ds", "{{ ds }}", "--lookback-days", str(config.spark.lookback_days)],
            name="features-{{ ds }}",
            outlets=[FEATURES],
            doc_md="Runbook: include/runbooks/features.md",
        )

    with TaskGroup("quality", tooltip="schema, row count, nulls, quarantine ratio") as quality:

        @task(retries=0)  # the same partition fails the same checks; fix the data, then clear the task
        def quality_gate(ds=None) -> dict:
            from hybridflow.pipeline.nightly_tasks import quality_gate

            return quality_gate(config, ds)

        gate = quality_gate()

    with TaskGroup("capacity", tooltip="free GPUs (or nodes up) in the planned partition") as capacity:
        wait_for_gpus = SlurmCapacitySensor(
            task_id="wait_for_gpus", partition=planned_placement("partition", repr(cluster.partition)),
            nodes="{{ params.nodes }}", gpus_per_node=planned_placement("gpus_per_node", "params.gpus_per_node"),
            ssh_conn_id=cluster.ssh_conn_id, poke_interval=15, timeout=6 * 3600,
        )

    with TaskGroup("training", tooltip="DeepSpeed on the planned Slurm partition (GPU or CPU)") as training:

        @task
        def prepare(params=None, ds=None, run_id=None) -> dict:
            from hybridflow.pipeline.nightly_tasks import prepare_training

            prepared_run = prepare_training(config, ds, run_id, params)
            print(f"Evaluation placement: {prepared_run['evaluation_placement']['reason']}")
            print(f"Training strategy: {prepared_run['training_strategy']}")
            return prepared_run

        prepared = prepare()
        train = DeepSpeedTrainingOperator(
            task_id="train",
            run_config=prepared_value("run_config"),
            run_dir=PREPARED_RUN.root,
            python=cluster.python,
            jobs_dir=cluster.jobs_dir,
            partition=planned_placement("partition", repr(cluster.partition)),
            nodes="{{ params.nodes }}",
            gpus_per_node=planned_placement("gpus_per_node", "params.gpus_per_node"),  # 0 on the CPU partition: no GRES
            ranks_per_node="{{ params.gpus_per_node }}",  # one rank per GPU, or as many CPU processes
            cpus_per_task=cfg.cpus_per_task,
            time_limit=cfg.time_limit_min,
            max_requeues=cluster.max_requeues,
            poll_interval_s=cluster.poll_interval_s,
            ssh_conn_id=cluster.ssh_conn_id,
            min_gpu_utilization_pct=cfg.min_gpu_utilization_pct,
            fail_on_low_utilization=cfg.fail_on_low_utilization,
            mlflow_experiment=cfg.mlflow_experiment,
            pool="gpu_training",
            execution_timeout=timedelta(minutes=cfg.time_limit_min * (cluster.max_requeues + 1)),
            runbook="include/runbooks/training.md",
            retrain="{{ params.retrain }}",  # prepare put the generation in run_dir; this puts it in the job name
            stall_timeout_s="{{ params.stall_timeout_s }}",
            stall_floor_s="{{ params.stall_floor_s }}",
            stall_factor="{{ params.stall_factor }}",
            stall_warm_up_steps="{{ params.stall_warm_up_steps }}",
        )
        prepared >> train

    with TaskGroup("checkpoint", tooltip="a complete checkpoint, manifest verified") as checkpoint:
        verified = CheckpointSensor(
            task_id="verified_checkpoint",
            checkpoint_root=PREPARED_RUN.checkpoints,
            min_step="{{ ti.xcom_pull(task_ids='" + NightlyTask.TRAIN + "')['metrics']['step'] }}",
            ssh_conn_id=cluster.ssh_conn_id, mode="poke", poke_interval=10, timeout=600,
        )

    with TaskGroup("evaluation", tooltip="challenger vs champion on the same holdout") as evaluation:
        # the generation in its job name too: a retrain evaluates the new model, not the earlier one's result
        evaluate = GenerationSlurmSubmitOperator(
            task_id="evaluate",
            retrain="{{ params.retrain }}",
            command=[cluster.python, f"{cluster.jobs_dir}/evaluate.py",
                     "--features-root", layout.dataset("features"),
                     "--ds", prepared_value("train_ds"),
                     "--challenger", PREPARED_RUN.model,
                     "--champion", prepared_value("champion_model"),
                     "--out", PREPARED_RUN.evaluation],
            # CPU or GPU by the pair's scoring cost (prepare decided it: pipeline.yaml placement.evaluation)
            partition=prepared_or("eval_partition", "'cpu'"), gpus_per_node=prepared_or("eval_gpus", "0"),
            hide_gpus_without_gres=True,
            cpus_per_task=1, time_limit=15, requeue=False, signal=None,
            log_dir=PREPARED_RUN.logs,
            ssh_conn_id=cluster.ssh_conn_id, poll_interval_s=3,
            runbook="include/runbooks/evaluation.md",
        )

        @task(outlets=[MODEL])
        def champion_challenger(prepared_run: dict, ds=None, run_id=None) -> dict:
            from hybridflow.pipeline.nightly_tasks import decide_and_publish

            decision = decide_and_publish(config, prepared_run, ds, run_id)
            print(decision["reason"])
            return decision

        decision = champion_challenger(prepared)

    with TaskGroup("scoring", tooltip="Spark batch scoring with the model of record") as scoring:

        @task(trigger_rule="none_failed_min_one_success")
        def model_of_record() -> dict:
            from hybridflow.pipeline.nightly_tasks import model_of_record

            return model_of_record(config)

        champion = model_of_record()
        score = StorageSparkSubmitOperator(
            task_id="score_batch",
            **spark_submit_defaults(),
            application=str(jobs_dir() / "score_batch.py"),
            application_args=["--root", root, "--ds", "{{ ds }}",
                              "--model", MODEL_OF_RECORD + "['model_path'] }}",
                              "--model-version", MODEL_OF_RECORD + "['version'] }}"],
            name="scoring-{{ ds }}",
            outlets=[PREDICTIONS],
            doc_md="Runbook: include/runbooks/scoring.md",
        )
        champion >> score

    with TaskGroup("deploy", tooltip="Triton: load beside the old version, smoke test, latency gate, shadow and "
                                     "canary, (deploy=ask) a person's approval, promote"):

        @task
        def plan_deploy(run_plan: dict, model: dict, ti=None) -> str:
            from airflow.sdk.exceptions import AirflowSkipException
            from hybridflow.pipeline.nightly_tasks import plan_deploy

            decision = ti.xcom_pull(task_ids=NightlyTask.CHAMPION_CHALLENGER) or {}
            deploy, reason = plan_deploy(config, run_plan, model, decision)
            print(f"Deploy: {reason}")
            if not deploy:
                raise AirflowSkipException(reason)
            return model["export_dir"]

        deploy_model = TritonDeployOperator(
            task_id="deploy_model",
            export_dir="{{ ti.xcom_pull(task_ids='" + NightlyTask.PLAN_DEPLOY + "') }}",
            # the registry version it is: the Triton version's record names it (on-call goes from one to the other)
            model_uri=MODEL_OF_RECORD + ".get('version_uri', '') }}",
            approval=("{{ 'ask' if ti.xcom_pull(task_ids='" + NightlyTask.PLAN + "')['deploy_mode'] == 'ask' "
                      "else 'auto' }}"),
            **deploy_kwargs(config.serving),
            pool="triton_deploy",
        )
        plan_deploy(run_plan, champion) >> deploy_model
        released = approval_tasks(deploy_model, config.serving.release)

    with TaskGroup("report", tooltip="HTML + JSON: volumes, quality, loss, GPU-hours, utilization, cost, latency"):
        report = RunReportOperator(task_id="write_report", trigger_rule="none_failed_min_one_success")

        # all_done: a deploy that rolled back is recorded too (write_report stays the leaf that fails the run)
        @task(trigger_rule="all_done")
        def record_in_registry(ds=None, run_id=None, ti=None) -> dict:
            from hybridflow.pipeline.nightly_tasks import record_in_registry

            deployed = (ti.xcom_pull(task_ids=NightlyTask.FINISH_RELEASE, key="deploy_report")
                        or ti.xcom_pull(task_ids=NightlyTask.DEPLOY_MODEL, key="deploy_report"))
            recorded = record_in_registry(config, ti.xcom_pull(task_ids=NightlyTask.MODEL_OF_RECORD), deployed, ds,
                                          run_id)
            print(f"MLflow registry: {recorded}")
            return recorded

        recorded = record_in_registry()

    # Wiring. Training hangs off the quality gate; scoring waits for the decision when there is one.
    raw_ready >> build_features >> gate
    [gate, preflight_ok] >> wait_for_gpus >> prepared
    train >> verified >> evaluate >> decision
    [gate, decision] >> champion
    score >> deploy_model
    released >> report
    score >> report
    [score, released] >> recorded
