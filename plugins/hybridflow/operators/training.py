"""DeepSpeed training as a Slurm job: the run config written to the cluster, the job followed, metrics back."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config import NightlyConfig
from hybridflow.exceptions import GateFailed, SlurmJobFailed
from hybridflow.layout import CONFIG_FILE, CREDENTIALS_FILE, EXPORT_FILES, METRICS_FILE, TrainingRunDir
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.ui import XCOM_MLFLOW_RUN_URL, MlflowRunLink
from hybridflow.utils.slurm import whole_number

if TYPE_CHECKING:
    from airflow.sdk import Context

    from hybridflow.utils.slurm_jobs import SlurmJobKey, SlurmJobStatus



def summarise_metrics(metrics: Mapping[str, Any]) -> dict:
    """The figures of the job's metrics.json that the pipeline passes on (XCom stays small)."""
    holdout = metrics.get("holdout") or {}
    deepspeed, allreduce = metrics.get("deepspeed") or {}, metrics.get("allreduce") or {}
    return {
        "auc": holdout.get("auc"), "log_loss": holdout.get("log_loss"), "step": metrics.get("step"),
        "total_steps": metrics.get("total_steps"), "restarts": metrics.get("restarts"),
        "resumed_from_step": metrics.get("resumed_from_step"),
        "train_rows_processed": metrics.get("train_rows_processed"),
        "mean_gpu_utilization_pct": metrics.get("mean_gpu_utilization_pct"),
        "world_size": deepspeed.get("world_size"), "nodes": deepspeed.get("nodes"),
        "ranks": [f"{r.get('rank')}@{r.get('node')}" for r in deepspeed.get("ranks") or []],
        "zero_stage": deepspeed.get("zero_stage"),
        "allreduce_share_in_job": allreduce.get("share"),
        "gpus_sampled": (metrics.get("gpu") or {}).get("per_gpu"),
    }


class GenerationSlurmSubmitOperator(SlurmSubmitOperator):
    """
    A Slurm job of one training generation, e.g. evaluating its model: ``retrain`` (templated, 0 by default) puts
    the generation in the job name, so generation N follows its own job (never twice) and not an earlier
    generation's COMPLETED one. Generation 0 keeps the plain name.
    """

    template_fields: Sequence[str] = (*SlurmSubmitOperator.template_fields, "retrain")

    def __init__(self, *, retrain: int | str = 0, **kwargs):
        super().__init__(**kwargs)
        self.retrain = retrain

    def job_key(self, context: Context) -> SlurmJobKey:
        from dataclasses import replace

        from hybridflow.utils.slurm_jobs import generation

        return replace(super().job_key(context), retrain=generation(self.retrain))


class DeepSpeedTrainingOperator(GenerationSlurmSubmitOperator):
    """
    Trains with ``jobs/train.py`` on the GPU partition. Writes ``run_config`` (with ``run_dir`` filled in) to
    ``<run_dir>/config.json`` on the cluster, submits (or reattaches to) the job, logs its progress file while
    deferred, and returns the job's status with the holdout metrics and a GPU utilization report: GPU-hours from
    the allocation, mean utilization from the job's own samples. Below ``min_gpu_utilization_pct`` it warns, or
    fails when ``fail_on_low_utilization``. A retry resumes from the newest complete checkpoint in ``run_dir``;
    a new model on purpose (e.g. after fixing data) takes a new ``retrain`` generation.

    :param run_config: the training run config, a mapping or its JSON text (templated, so it can come from an
        upstream task's XCom); see jobs/hybridtrain/config.py.
    :param run_dir: the run's directory on the cluster's filesystem (templated).
    :param python: the cluster's job interpreter; ``jobs_dir`` where jobs/ is deployed there.
    :param retrain: the training generation (templated). 0: a cleared or rerun task follows the job its run already
        ran, even a COMPLETED one (never twice). N > 0: generation N's own job and run directory
        ``<run_dir>.retrain-<N>``, fresh (no checkpoint of an earlier generation), each at most once; the paths
        derived from ``run_dir`` (config, logs, progress) follow it.

    Data-parallel: ``nodes`` x ``gpus_per_node`` ranks, one per GPU, started by ``srun`` (``ranks_per_node``
    defaults to ``gpus_per_node``); the job reads its rank, world size and master address from Slurm.

    CPU placement (``gpus_per_node`` 0, ``ranks_per_node`` N, on a CPU partition): no GRES, N CPU processes per
    node (gloo), ``CUDA_VISIBLE_DEVICES`` empty; the utilization report then reads "no GPU allocated (cpu
    placement)" instead of judging GPU utilization.

    Tracking (``mlflow_conn_id``; None turns it off): the task is one MLflow run in ``mlflow_experiment`` per
    generation, found again by every retry, clear and requeue (its id in ``<run_dir>/mlflow_run.json``). Rank 0
    logs step figures live where the compute nodes reach the server; after the job this task logs what the server
    has not got (``step_metrics.jsonl``), the final figures, tags and the artifacts (run config, metrics, the
    exported model with its signature and input example). An unreachable server never stops training: the task
    says so, and if the server is still down once the job has COMPLETED the task fails so that its retry
    (reattaching to the finished job, not training again) logs the run.
    """

    template_fields: Sequence[str] = (*GenerationSlurmSubmitOperator.template_fields, "run_config", "run_dir")
    operator_extra_links = (*GenerationSlurmSubmitOperator.operator_extra_links, MlflowRunLink())
    template_fields_renderers = {**SlurmSubmitOperator.template_fields_renderers, "run_config": "json"}

    def __init__(self, *, run_config: Mapping[str, Any] | str, run_dir: str, python: str, jobs_dir: str,
                 min_gpu_utilization_pct: float = NightlyConfig.min_gpu_utilization_pct,
                 fail_on_low_utilization: bool = NightlyConfig.fail_on_low_utilization,
                 mlflow_conn_id: str | None = "mlflow_default",
                 mlflow_experiment: str = NightlyConfig.mlflow_experiment, **kwargs):
        from hybridflow.config import pipeline_config
        from hybridflow.utils.mlflow_tracking import validate_experiment_name

        # paths derived from run_dir move with it to a generation's directory; ones given explicitly stay
        paths_from_run_dir = {key for key in ("log_dir", "progress_path", "heartbeat_dir") if key not in kwargs}
        run = TrainingRunDir(run_dir)
        kwargs.setdefault("log_dir", run.logs)
        kwargs.setdefault("progress_path", run.progress)
        # the stall watch: every rank's heartbeat under the run directory; py-spy beside the job's interpreter
        kwargs.setdefault("heartbeat_dir", run.heartbeats)
        recovery = pipeline_config().recovery
        for key in ("stall_timeout_s", "stall_floor_s", "stall_factor", "stall_warm_up_steps", "max_stall_restarts"):
            kwargs.setdefault(key, getattr(recovery, key))
        kwargs.setdefault("py_spy", f"{python.rsplit('/', 1)[0]}/py-spy" if "/" in python else "py-spy")
        kwargs.setdefault("ranks_per_node", kwargs.get("gpus_per_node", 1))
        kwargs.setdefault("hide_gpus_without_gres", True)  # the CPU placement trains on CPUs, whatever the node has
        # Training runs minutes to hours on a real cluster: waiting for its end in the worker first buys nothing.
        kwargs.setdefault("wait_before_defer_s", 0)
        super().__init__(command=[python, f"{jobs_dir}/train.py", "--config", run.config], **kwargs)
        self.run_config = run_config if isinstance(run_config, str) else dict(run_config)
        self.run_dir = run_dir
        self.python, self.jobs_dir = python, jobs_dir
        self.min_gpu_utilization_pct = min_gpu_utilization_pct
        self.fail_on_low_utilization = fail_on_low_utilization
        self.mlflow_conn_id = mlflow_conn_id
        self.mlflow_experiment = validate_experiment_name(mlflow_experiment, "mlflow_experiment")
        self._paths_from_run_dir = paths_from_run_dir
        self._context: Context | None = None

    @property
    def training_run(self) -> TrainingRunDir:
        """The run directory (``run_dir``, once rendered and moved to its generation's) and its files."""
        return TrainingRunDir(self.run_dir)

    def render_template_fields(self, context: Context, jinja_env=None) -> None:
        super().render_template_fields(context, jinja_env)
        self._apply_generation()  # here, so the rendered fields shown in the UI are the paths the job uses

    def _apply_generation(self) -> None:
        """Moves the run to its generation's directory (idempotent): a retrain must not resume, from the earlier
        generation's checkpoints, a model that already finished."""
        from hybridflow.utils.slurm_jobs import generation

        moved = self.training_run.for_generation(generation(self.retrain))
        if moved == self.training_run:
            return
        self.run_dir = moved.root
        self.command = [*self.command[:-1], moved.config]
        if "log_dir" in self._paths_from_run_dir:
            self.log_dir = moved.logs
        if "progress_path" in self._paths_from_run_dir:
            self.progress_path = moved.progress
        if "heartbeat_dir" in self._paths_from_run_dir:
            self.heartbeat_dir = moved.heartbeats

    def node_self_check(self) -> tuple[str, ...]:
        """Each node checks itself before the ranks start (pipeline.yaml ``recovery.node_check``)."""
        from hybridflow.config import pipeline_config

        recovery = pipeline_config().recovery
        if not recovery.node_check:
            return ()
        argv = [self.python, f"{self.jobs_dir}/node_check.py", "--checkpoint-dir", self.run_dir,
                "--gpus-per-node", str(whole_number(self.gpus_per_node, "gpus_per_node")),
                "--min-free-gib", f"{recovery.node_min_free_gib:g}"]
        return (*argv, "--scratch-dir", recovery.node_scratch_dir) if recovery.node_scratch_dir else tuple(argv)

    def execute(self, context: Context) -> dict:
        self._apply_generation()  # again for callers that run execute() without rendering first
        run_config = json.loads(self.run_config) if isinstance(self.run_config, str) else self.run_config
        if not isinstance(run_config, dict):
            raise TypeError(f"run_config must be a JSON object, got {type(run_config).__name__}")
        self.hook.run(["mkdir", "-p", "--", self.run_dir])
        self._context = context
        job_config = {**run_config, "run_dir": self.run_dir, **self._collective_timeout(run_config)}
        tracking = self._start_tracking(context, run_config)
        if tracking is not None:
            job_config["tracking"] = tracking
        self.hook.write_text(self.training_run.config, json.dumps(job_config, indent=2, sort_keys=True))
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        self._context = context
        return super().execute_complete(context, event)

    def _collective_timeout(self, run_config: Mapping[str, Any]) -> dict[str, float]:
        """``collective_timeout_s`` above the stall watch's longest deadline (gloo and NCCL alike: every process
        group's), so the watch finds and names a hung rank before a collective fails the job unnamed."""
        watch = self.stall_watch
        given = run_config.get("collective_timeout_s")
        if watch is None or (isinstance(given, int | float) and given >= watch.collective_timeout_s):
            return {}
        if given is not None:
            self.log.info("collective_timeout_s raised from %s to %g s: above the stall watch's stall_timeout_s=%g",
                          given, watch.collective_timeout_s, watch.timeout_s)
        return {"collective_timeout_s": watch.collective_timeout_s}

    # --- MLflow ---------------------------------------------------------------------------------------------

    def _mlflow(self):
        """The hook, or None when tracking is off (no conn id, or the connection is not defined: said once)."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        from hybridflow.hooks.mlflow import MlflowHook

        if not self.mlflow_conn_id:
            return None
        hook = MlflowHook(self.mlflow_conn_id)
        try:
            hook.tracking_uri  # noqa: B018 (reads the connection)
        except AirflowNotFoundException:
            self.log.warning("connection %r is not defined: this training run is not tracked in MLflow (define it, "
                             "README 'Pointing it at real clusters', or pass mlflow_conn_id=None)", self.mlflow_conn_id)
            return None
        return hook

    def _identity(self, context: Context):
        from hybridflow.utils.mlflow_tracking import TrainingRunIdentity
        from hybridflow.utils.slurm_jobs import generation

        ti = context["ti"]
        return TrainingRunIdentity(ti.dag_id, ti.task_id, ti.run_id, generation(self.retrain))

    def _tracking_run(self, mlflow, context: Context, run_config: Mapping[str, Any] | None) -> dict:
        """This task's MLflow run: the one its run directory names, else the one tagged with its identity, else a
        new one (a retrain generation's linked to generation 0's). Params are logged once, before the job."""
        import time

        from hybridflow.utils import mlflow_tracking as tracking

        identity = self._identity(context)
        run_file = self.training_run.mlflow_run
        stored = tracking.stored_run_id(self.hook.read_text(run_file))
        run = mlflow.get_run(stored) if stored else None
        if run is None:
            experiment_id = mlflow.experiment_id(self.mlflow_experiment)
            run = mlflow.find_run_by_tag(experiment_id, tracking.RUN_KEY_TAG, identity.key_sha)
            if run is None:
                tags = tracking.start_tags(identity, try_number=getattr(context["ti"], "try_number", None),
                                           ds=context.get("ds")) | tracking.job_name_tags(self.job_name(context))
                if identity.generation:
                    first = mlflow.find_run_by_tag(experiment_id, tracking.RUN_KEY_TAG,
                                                   identity.first_generation().key_sha)
                    if first is not None:
                        tags[tracking.RETRAIN_OF_TAG] = first["info"]["run_id"]
                run = mlflow.create_run(experiment_id, identity.run_name, tags, int(time.time() * 1000))
            self.hook.write_text(run_file, json.dumps({
                "run_id": run["info"]["run_id"], "experiment_id": run["info"]["experiment_id"],
                "tracking_uri": mlflow.tracking_uri}, indent=2) + "\n")
        if run["info"].get("status") != "RUNNING":  # an earlier attempt's job failed; this attempt goes on
            mlflow.set_status(run["info"]["run_id"], "RUNNING")
        if run_config is not None and not (run.get("data") or {}).get("params"):
            mlflow.log_batch(run["info"]["run_id"], params=tracking.training_params(
                run_config, nodes=whole_number(self.nodes, "nodes"), gpus_per_node=whole_number(self.gpus_per_node,
                "gpus_per_node"), ranks_per_node=whole_number(self.ranks_per_node, "ranks_per_node")))
        return run

    def _start_tracking(self, context: Context, run_config: Mapping[str, Any]) -> dict | None:
        """The job's ``tracking`` section (its MLflow run, the server as the nodes see it, a 0600 credentials
        file), or None when tracking is off or the server does not answer now."""
        from hybridflow.exceptions import MlflowUnavailable

        mlflow = self._mlflow()
        if mlflow is None:
            return None
        try:
            run = self._tracking_run(mlflow, context, run_config)
        except MlflowUnavailable as error:
            self.log.warning("MLflow unavailable before the job (%s): training goes on without live tracking; this "
                             "task logs the run after the job", error)
            return None
        self.hook.write_private(self.training_run.credentials, json.dumps(mlflow.job_credentials()))
        url = mlflow.run_url(run["info"]["experiment_id"], run["info"]["run_id"])
        context["ti"].xcom_push(key=XCOM_MLFLOW_RUN_URL, value=url)  # the task's "MLflow run" link, from now on
        self.log.info("MLflow run %s: %s", run["info"]["run_id"], url)
        return {"uri": mlflow.tracking_uri_on_cluster, "run_id": run["info"]["run_id"],
                "credentials_file": CREDENTIALS_FILE}

    def _log_step_metrics(self, mlflow, run_id: str) -> tuple[int, int]:
        """The job's step points the run lacks (not sent live); (logged now, written by the job)."""
        from hybridflow.utils import mlflow_tracking as tracking

        records = tracking.read_step_metrics(self.hook.read_text(self.training_run.step_metrics) or "")
        missing = tracking.records_to_log(records, mlflow.logged_steps(run_id, {r["key"] for r in records}))
        mlflow.log_batch(run_id, metrics=missing)
        return len(missing), len(records)

    def _end_mlflow_run_failed(self, status: SlurmJobStatus) -> None:
        """A failed job: its steps logged, the run FAILED with the job's end in tags (a retry reopens it). Best
        effort: the job's failure is what the task reports."""
        import time

        from hybridflow.exceptions import MlflowUnavailable
        from hybridflow.utils import mlflow_tracking as tracking

        mlflow = self._mlflow()
        run_id = tracking.stored_run_id(self.hook.read_text(self.training_run.mlflow_run))
        try:
            if mlflow is not None and run_id is not None:
                self._log_step_metrics(mlflow, run_id)
                mlflow.log_batch(run_id, tags={"hybridflow.slurm_job_id": status.job_id,
                                               "hybridflow.job_end": _job_end(status)})
                mlflow.finish_run(run_id, "FAILED", int(time.time() * 1000))
        except MlflowUnavailable as error:
            self.log.warning("could not mark MLflow run %s FAILED: %s", run_id, error)
        finally:
            self.hook.remove(self.training_run.credentials)

    def _log_to_mlflow(self, status: SlurmJobStatus, metrics: Mapping[str, Any], gpu_hours: float | None,
                       efficiency: Mapping[str, Any] | None = None):
        """After a COMPLETED job: what the run lacks (steps the job could not log live), final figures, tags,
        artifacts; the run FINISHED. Returns the run's id and address for the XCom, or None when tracking is off.
        Raises MlflowUnavailable (the task fails; its retry reattaches to the finished job and logs again)."""
        import time

        from hybridflow.utils import mlflow_tracking as tracking

        mlflow = self._mlflow()
        if mlflow is None or self._context is None:
            return None
        run_config_text = self.hook.read_text(self.training_run.config) or "{}"
        run_config = json.loads(run_config_text)
        run_config.pop("tracking", None)
        run = self._tracking_run(mlflow, self._context, run_config)
        run_id, experiment_id = run["info"]["run_id"], run["info"]["experiment_id"]
        logged_now, written = self._log_step_metrics(mlflow, run_id)
        step = metrics.get("step") or 0
        final = [{"key": key, "value": value, "timestamp": int(time.time() * 1000), "step": step}
                 for key, value in tracking.final_metrics(metrics, gpu_hours=gpu_hours,
                                                                          efficiency=efficiency).items()]
        already = tracking.records_to_log(final, mlflow.logged_steps(run_id, {r["key"] for r in final}))
        mlflow.log_batch(run_id, metrics=already,
                         tags=tracking.finish_tags(metrics, slurm_job_id=status.job_id, partition=self.partition)
                         | {"hybridflow.job_end": _job_end(status)})
        artifact_uri = run["info"]["artifact_uri"]
        # the artifacts keep the run directory's file names
        mlflow.upload_artifact(artifact_uri, f"run/{CONFIG_FILE}", run_config_text.encode())
        mlflow.upload_artifact(artifact_uri, f"run/{METRICS_FILE}", json.dumps(metrics, indent=2).encode())
        for name in EXPORT_FILES:
            content = self.hook.read_bytes(self.training_run.export_file(name))
            if content is not None:
                mlflow.upload_artifact(artifact_uri, f"model/{name}", content)
        mlflow.finish_run(run_id, "FINISHED", int(time.time() * 1000))
        self._context["ti"].xcom_push(key=XCOM_MLFLOW_RUN_URL, value=mlflow.run_url(experiment_id, run_id))
        self.hook.remove(self.training_run.credentials)
        self.log.info("MLflow run %s FINISHED: %d step points logged after the job (%d were live), %d final "
                      "figures, model artifacts; %s", run_id, logged_now, written - logged_now, len(already),
                      mlflow.run_url(experiment_id, run_id))
        return {"run_id": run_id, "experiment_id": experiment_id, "url": mlflow.run_url(experiment_id, run_id),
                "logged_after_job": logged_now}

    def _time_split(self, status: SlurmJobStatus, metrics: Mapping[str, Any],
                    mean_gpu_utilization_pct: float | None) -> dict | None:
        """Where the job's allocated time went (rank 0's phases, metrics.json), logged; left for the partition
        ledger (``<storage>/utilization/jobs/<job id>.json``) with the GPUs' measured mean utilization where
        nvidia-smi sampled them (the ledger's busy GPU-hours). None when the job wrote no split."""
        from hybridflow.atomic import write_json_atomic
        from hybridflow.config import pipeline_config
        from hybridflow.utils.efficiency import describe_time_shares, time_shares

        split = time_shares(metrics.get("time_split_s"), status.elapsed_s)
        self.log.info("Where the job's %.0f s went: %s", status.elapsed_s or 0,
                      describe_time_shares(split) or "not measured (the job wrote no time_split_s)")
        if split is None and mean_gpu_utilization_pct is None:
            return None  # nothing for the ledger
        figures = {"job_id": status.job_id, **(split or {}), "mean_gpu_utilization_pct": mean_gpu_utilization_pct}
        folder = Path(pipeline_config().storage.layout.utilization_jobs)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_json_atomic(folder / f"{status.job_id}.json", figures, mode=0o664)
        except OSError as error:  # the ledger then lacks this job's figures; the training result stands
            self.log.warning("could not leave the job's figures for the ledger in %s: %s", folder, error)
        return split

    def _finish(self, status: SlurmJobStatus, message: str = "", handback: Mapping[str, Any] | None = None) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.pipeline.gates import utilization_report
        from hybridflow.utils.slurm_jobs import generation

        try:
            result = super()._finish(status, message, handback)  # raises unless the job COMPLETED (or defers, requeued)
        except (SlurmJobFailed, AirflowFailException):
            self._end_mlflow_run_failed(status)
            raise
        metrics = json.loads(self.hook.read_text(self.training_run.metrics) or "{}")
        allocated = status.alloc_tres.get("gres/gpu")
        gpus = int(allocated) if str(allocated or "").isdigit() else None
        report = utilization_report(gpus, status.elapsed_s, metrics.get("gpu"), self.min_gpu_utilization_pct,
                                    side=self.placement_side)
        # the run is the record of what was trained, also when the utilization gate then fails the task
        tracked = self._log_to_mlflow(status, metrics, report.gpu_hours, result.get("efficiency"))
        if report.verdict == "low" and self.fail_on_low_utilization:
            raise GateFailed(report.message)
        (self.log.warning if report.verdict != "ok" else self.log.info)("GPU utilization: %s", report.message)
        result.update(
            run_dir=self.run_dir,
            partition=self.partition,
            placement_side=self.placement_side,
            retrain=generation(self.retrain),
            metrics=summarise_metrics(metrics),
            utilization={"gpu_hours": report.gpu_hours, "mean_utilization_pct": report.mean_utilization_pct,
                         "verdict": report.verdict, "message": report.message},
        )
        result["mlflow"] = tracked
        result["time_split"] = self._time_split(status, metrics, report.mean_utilization_pct)
        summary = result["metrics"]
        self.log.info("Training finished: holdout AUC %s, log loss %s at step %s of %s; ranks %s; restarts %s",
                      _figure(summary["auc"]), _figure(summary["log_loss"]), summary["step"], summary["total_steps"],
                      ", ".join(summary["ranks"]) or "?", summary["restarts"] or 0)
        return result


def _job_end(status: SlurmJobStatus) -> str:
    """How a job ended, as its MLflow tag: ``COMPLETED 0:0``, ``FAILED 2:0``."""
    return f"{status.state} {status.exit_code}:{status.exit_signal}"


def _figure(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "not measured"
