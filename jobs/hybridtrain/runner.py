"""The training job from start to finish: data, DeepSpeed, resume, the loop, checkpoints, evaluation, export.

Files under ``run_dir``: ``progress.json`` (see ``progress``), ``checkpoints/step_<n>/`` (see
``checkpoints``), ``metrics.json`` (written once training finished), ``gpu_metrics.rank<r>.jsonl`` (see
``gpu``), ``heartbeats/rank<r>.json`` (see ``heartbeat``), ``step_metrics.jsonl`` (rank 0's step figures, see
``tracking``), ``export/`` (see ``export``) and ``torch_extensions/`` (TORCH_EXTENSIONS_DIR, unless set: DeepSpeed
builds nothing there unless a config asks for a JIT op). Every rank writes its checkpoint shards, its own GPU
samples and its heartbeat; only rank 0 writes the others.

One optimizer step is ``gradient_accumulation_steps`` micro-batches of ``batch_size`` rows on every rank: the
loop calls ``engine.backward`` and ``engine.step`` per micro-batch, and DeepSpeed (0.19.8,
``runtime/engine.py``) divides each loss by the accumulation count in ``backward`` (``scale_wrt_gas``) and
steps the optimizer only at the accumulation boundary (``(micro_steps + 1) % gradient_accumulation_steps``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from hybridjobs.layout import METRICS_FILE, PROGRESS_FILE, SMOKE_FILE, STEP_METRICS_FILE
from hybridtrain.allreduce import is_sample_step, summarise_allreduce
from hybridtrain.checkpoints import (
    MANIFEST_NAME,
    build_manifest,
    checkpoints_to_prune,
    remove_checkpoint,
    resume_refusal,
    select_resume_checkpoint,
    step_dir_name,
    write_json_atomic,
    write_manifest,
)
from hybridtrain.config import RunConfig, deepspeed_settings_for_run, load_run_config, settings_for_device
from hybridtrain.errors import ExitCode, FeatureDataError, ResumeError, TrainingJobError, collective_failure
from hybridtrain.evaluation import log_loss, roc_auc
from hybridtrain.features import HOLDOUT_RULE, holdout_mask, read_feature_partitions, standardization
from hybridtrain.gpu import (
    GpuSampler,
    bound_gpu_ids,
    gpu_metrics_file,
    read_run_gpu_metrics,
    summarise_gpu_metrics,
)
from hybridtrain.heartbeat import Heartbeat
from hybridtrain.launch import (
    describe_ranks,
    distributed_environment,
    free_port,
    log_format,
    node_name,
    restart_count,
)
from hybridtrain.plan import TrainingPlan, epoch_permutation, make_plan
from hybridtrain.preemption import StopRequest, requeue_job
from hybridtrain.progress import ProgressReporter, read_progress
from hybridtrain.tracking import (
    LiveTracking,
    MlflowRest,
    StepMetricsLog,
    TrackingUnavailable,
    code_version,
    read_credentials,
)

__all__ = ["PreparedData", "TrainingJob", "main", "prepare_data"]

log = logging.getLogger("hybridtrain")

_EVAL_CHUNK_ROWS = 65_536
# The engine computes in bf16/fp16 when the DeepSpeed config says so; the export always in float32.
_EXPORT_TOLERANCE = {True: 1e-5, False: 2e-2}
_TOKEN_DEFINITION = "one training row (a customer-day of features) = one token"


@dataclass(frozen=True)
class PreparedData:
    """The split, standardised arrays the loop reads; ``fingerprint`` identifies the data for resumes."""

    feature_columns: tuple[str, ...]
    train_x: np.ndarray
    train_y: np.ndarray
    holdout_x: np.ndarray
    holdout_y: np.ndarray
    holdout_raw: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    rows_per_partition: dict[str, int]
    fingerprint: str


def prepare_data(config: RunConfig) -> PreparedData:
    """Read the partitions, split off the holdout by customer, and standardise with the training statistics.

    :raises FeatureDataError: the data is invalid, or a split would be empty.
    """
    data = read_feature_partitions(config.features_root, config.ds)
    holdout = holdout_mask(data.customer_ids, config.holdout_fraction)
    if holdout.all() or not holdout.any():
        raise FeatureDataError(
            f"holdout_fraction {config.holdout_fraction} puts {int(holdout.sum())} of {len(data)} rows in "
            "the holdout: both splits need rows (train on more customers or change holdout_fraction)"
        )
    mean, std = standardization(data.features[~holdout])
    digest = hashlib.sha256("\x1f".join(data.feature_columns).encode())
    for array in (data.features, data.labels, holdout):
        digest.update(np.ascontiguousarray(array).data)
    raw_holdout = data.features[holdout]
    return PreparedData(
        feature_columns=data.feature_columns,
        train_x=(data.features[~holdout] - mean) / std,
        train_y=data.labels[~holdout],
        holdout_x=(raw_holdout - mean) / std,
        holdout_y=data.labels[holdout],
        holdout_raw=raw_holdout,
        mean=mean,
        std=std,
        rows_per_partition=data.rows_per_partition,
        fingerprint=digest.hexdigest(),
    )


class TrainingJob:
    """One attempt of a run: resumes from the newest complete checkpoint and trains to the planned step."""

    def __init__(self, config: RunConfig, stop: StopRequest, started: float) -> None:
        self.config = config
        self.stop = stop
        self.rank = 0
        self.reporter: ProgressReporter | None = None
        self.heartbeat: Heartbeat | None = None
        self.started = started

    # --- the attempt ----------------------------------------------------------------------------------------

    def run(self) -> ExitCode:
        config = self.config
        environment = distributed_environment(os.environ, free_port)
        os.environ.update(environment)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(config.run_dir / "torch_extensions"))
        self.rank = int(environment["RANK"])
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        self.heartbeat = Heartbeat(config.run_dir, rank=self.rank, node=node_name(os.environ, platform.node()),
                                   environ=os.environ, every_s=config.heartbeat_every_s).start()
        try:
            code = self._run(environment)
        except BaseException:
            self.heartbeat.stop("failed")
            raise
        self.heartbeat.stop("exited")
        return code

    def _run(self, environment: Mapping[str, str]) -> ExitCode:
        config = self.config
        world_size = int(environment["WORLD_SIZE"])
        self.heartbeat.beat(phase="loading data")
        data = prepare_data(config)
        plan = make_plan(
            n_train_rows=len(data.train_y),
            batch_size=config.batch_size,
            world_size=world_size,
            seed=config.seed,
            epochs=config.epochs,
            max_steps=config.max_steps,
            accumulation=config.gradient_accumulation_steps,
        )
        log.info(
            "data: %d training rows, %d holdout rows, %d features from %d partitions; plan: %d steps (%d per "
            "epoch, %d rows per step = micro-batch %d x %d accumulation steps x %d ranks)",
            len(data.train_y),
            len(data.holdout_y),
            len(data.feature_columns),
            len(data.rows_per_partition),
            plan.total_steps,
            plan.steps_per_epoch,
            plan.rows_per_step,
            plan.batch_size,
            plan.accumulation,
            plan.world_size,
        )
        previous = read_progress(config.run_dir / PROGRESS_FILE) if self.rank == 0 else None
        restarts = restart_count(os.environ, None if previous is None else previous.get("restarts"))
        self.reporter = ProgressReporter(
            config.run_dir / PROGRESS_FILE,
            every_s=config.progress_every_s,
            rows_per_step=plan.rows_per_step,
            static={
                "run_id": config.run_id,
                "total_steps": plan.total_steps,
                "epochs_total": -(-plan.total_steps // plan.steps_per_epoch),
                "restarts": restarts,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            },
        )
        if self.rank == 0:
            self.reporter.update(state="starting", step=0, force=True, last_checkpoint_step=None)

        ds_config, notes = deepspeed_settings_for_run(
            config.deepspeed_settings,
            batch_size=config.batch_size,
            world_size=world_size,
            learning_rate=config.learning_rate,
            zero_stage=config.zero_stage,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
        for note in notes:
            log.info("DeepSpeed config: %s", note)
        self.heartbeat.beat(phase="rendezvous")
        try:
            trainer = _Trainer(self, data, plan, ds_config, restarts)
            code = trainer.train()
        except RuntimeError as error:
            failure = collective_failure(f"{type(error).__name__}: {error}", config.collective_timeout_s)
            if failure is None:
                raise
            raise failure from error
        from hybridtrain.engine import end_process_group

        end_process_group(trainer.device)  # after a failure the process exits without it: a peer may be gone
        return code

    def report_failure(self, error: BaseException) -> None:
        """Leave the failure in progress.json for the orchestrator (rank 0, once the run dir exists)."""
        if self.rank != 0 or not self.config.run_dir.is_dir():
            return
        path = self.config.run_dir / PROGRESS_FILE
        payload = {
            **(read_progress(path) or {}),
            "state": "failed",
            "error": f"{type(error).__name__}: {error}",
        }
        payload["updated_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        write_json_atomic(path, payload)


class _Trainer:
    """The part of an attempt that needs torch and DeepSpeed (imported here, after the config is valid)."""

    def __init__(
        self,
        job: TrainingJob,
        data: PreparedData,
        plan: TrainingPlan,
        ds_config: dict[str, Any],
        restarts: int,
    ) -> None:
        import deepspeed
        import torch
        from hybridtrain import engine as ds_engine
        from hybridtrain.export import PRECISION_SAMPLE_ROWS, SMOKE_ROWS, export_model
        from hybridtrain.model import build_network, count_parameters

        self.torch = torch
        self.deepspeed = deepspeed
        self.ds = ds_engine
        self.export_model = export_model
        ds_config, self.clip_norm, notes = settings_for_device(ds_config, cuda=torch.cuda.is_available())
        for note in notes:
            log.info("DeepSpeed config: %s", note)
        # The serving smoke set: the first holdout rows (repeated when the holdout is smaller).
        self.smoke_inputs = np.resize(data.holdout_raw[:SMOKE_ROWS], (SMOKE_ROWS, len(data.feature_columns)))
        # The rows the export's bf16 check scores besides the smoke set, with their labels.
        self.precision_sample = (data.holdout_raw[:PRECISION_SAMPLE_ROWS], data.holdout_y[:PRECISION_SAMPLE_ROWS])
        self.job = job
        self.config = job.config
        self.data = data
        self.plan = plan
        self.ds_config = ds_config
        self.restarts = restarts
        self.rank = job.rank
        self.reporter = job.reporter
        self.heartbeat = job.heartbeat
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

        threads = self.config.torch_threads or _slurm_cpus(os.environ)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(self.config.seed)
        network = build_network(len(data.feature_columns), self.config.model)
        self.n_parameters = count_parameters(network)
        # Counted before DeepSpeed wraps the network: ZeRO-3 leaves each rank only its partition.
        self.n_trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.engine, self.device = ds_engine.init_engine(
            network, ds_config, self.local_rank, timeout_s=self.config.collective_timeout_s
        )
        self.dtype = ds_engine.input_dtype(ds_config)
        self.autocast = _autocast(self.config.precision, self.device, self.dtype, torch)
        self.control_group = ds_engine.control_group(self.device)
        self.ranks = ds_engine.gather_objects(
            {"rank": self.rank, "node": node_name(os.environ, platform.node()), "local_rank": self.local_rank}
        )
        self.nodes, placement = describe_ranks(self.ranks)
        log.info("ranks: %s", placement)
        self.reporter.fields["ranks"] = placement  # progress.json: the orchestrator's log names them too
        # The whole training split lives on the device (tabular rows are small next to GPU memory), and so does
        # the epoch's order of rows (copied once per epoch): a step slices its batch there, with no host copy
        # (a copy from pageable host memory waits for the GPU's queue to drain).
        self.train_x = torch.from_numpy(data.train_x).to(self.device, dtype=self.dtype)
        self.train_y = torch.from_numpy(data.train_y).to(self.device)
        self._order: tuple[int, Any] | None = None
        log.info(
            "compute: %s on %s; gradient clipping by %s; optimizer %s",
            self.precision_name,
            self.device,
            "the loop" if self.clip_norm else "DeepSpeed",
            "fused" if (ds_config.get("optimizer") or {}).get("params", {}).get("fused") else "unfused",
        )
        self.resume_key = {
            "plan": {k: v for k, v in plan.as_dict().items() if k != "total_steps"},
            "data_sha256": data.fingerprint,
            "hidden_sizes": list(self.config.model.hidden_sizes),
            "dropout": self.config.model.dropout,
            "zero_stage": self.config.zero_stage,
        }
        self.step = 0
        self.resumed_from: int | None = None
        self.last_checkpoint: int | None = None
        self.loss_curve: list[list[float]] = []
        self.train_wall_prior_s = 0.0
        self.loop_started = time.monotonic()
        self.last_loss: float | None = None
        self.evaluation: dict[str, Any] | None = None
        # [step, step_ms, comm_ms] of the measured steps (see hybridtrain.allreduce), kept across resumes.
        self.allreduce_samples: list[list[float | None]] = []
        self._comm_buffer: Any = None
        self.step_log: StepMetricsLog | None = None

    # --- main loop ------------------------------------------------------------------------------------------

    def train(self) -> ExitCode:
        torch = self.torch
        self.heartbeat.beat(phase="resuming")
        self._resume()
        # Every rank samples the GPU(s) Slurm bound to it, into its own file (see hybridtrain.gpu).
        sampler = GpuSampler(
            gpu_metrics_file(self.config.run_dir, self.rank),
            self.config.gpu_sample_every_s,
            rank=self.rank,
            gpu_ids=bound_gpu_ids(os.environ),
        )
        sampler.start()
        self.step_log = self._open_step_log()
        try:
            self.loop_started = time.monotonic()
            self.reporter.restart_rate(self.step)
            self._report("training", force=True)
            self.heartbeat.beat(step=self.step, phase="training")
            loss_sum = torch.zeros((), device=self.device)
            losses = 0
            self.engine.train()
            while self.step < self.plan.total_steps:
                stop_code = self.ds.max_across_ranks(self.job.stop.code, self.control_group)
                if stop_code:
                    return self._stop(stop_code)
                measure = is_sample_step(self.step, self.config.allreduce_sample_every_steps)
                if measure:
                    self.ds.synchronize(self.device)
                    started = time.perf_counter()
                # DeepSpeed divides each micro-batch's loss by the accumulation count and steps the optimizer
                # only after the last micro-batch (its accumulation boundary).
                for micro in range(self.plan.accumulation):
                    loss_sum += self._micro_step(micro)
                    losses += 1
                if measure:
                    self.ds.synchronize(self.device)
                    self._measure_allreduce(time.perf_counter() - started)
                self.step += 1
                self.heartbeat.beat(step=self.step)
                if self.step % self.config.log_every_steps == 0 or self.step == self.plan.total_steps:
                    self._record_loss(self.ds.mean_across_ranks(loss_sum / losses))
                    loss_sum.zero_()
                    losses = 0
                if self.step % self.config.checkpoint_every_steps == 0 or self.step == self.plan.total_steps:
                    self._checkpoint(evaluate=True)
                elif self._report("training"):
                    self._log_progress()
            return self._finish()
        finally:
            sampler.stop()
            if self.step_log is not None:
                self.step_log.close()

    def _open_step_log(self) -> StepMetricsLog | None:
        """Rank 0's step figures: the file always, MLflow live when the run config names a run (see tracking)."""
        if self.rank != 0:
            return None
        live, tracking = None, self.config.tracking
        if tracking is not None:
            try:
                username, password = read_credentials(tracking.credentials_file)
            except TrackingUnavailable as error:
                log.warning("MLflow tracking unavailable (%s): training goes on; the Airflow task logs %s after "
                            "the job", error, STEP_METRICS_FILE)
            else:
                client = MlflowRest(tracking.uri, username, password)
                live = LiveTracking(client, tracking.run_id, tracking.flush_every_s).start()
                log.info("tracking: logging live to MLflow run %s at %s", tracking.run_id, tracking.uri)
        return StepMetricsLog(self.config.run_dir / STEP_METRICS_FILE, self.plan.rows_per_step, live)

    def _micro_step(self, micro: int) -> Any:
        """Forward and backward of micro-batch ``micro`` of the current step, and ``engine.step``; the loss."""
        torch = self.torch
        epoch, start = self.plan.batch_position(self.step, self.rank, micro)
        if self._order is None or self._order[0] != epoch:
            order = epoch_permutation(self.plan.n_train_rows, self.plan.seed, epoch)
            self._order = (epoch, torch.from_numpy(order.copy()).to(self.device))
        rows = self._order[1][start : start + self.plan.batch_size]
        inputs = self.train_x.index_select(0, rows)
        labels = self.train_y.index_select(0, rows)
        torch.manual_seed(_step_seed(self.config.seed, self.step, micro))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.engine(inputs).squeeze(1).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.engine.backward(loss)
        if self.clip_norm and micro == self.plan.accumulation - 1:  # gradients are all-reduced by now
            torch.nn.utils.clip_grad_norm_(self.engine.module.parameters(), self.clip_norm, foreach=True)
        self.engine.step()
        return loss.detach()

    @property
    def precision_name(self) -> str:
        """What the network computes in: ``bf16-autocast`` (float32 weights), ``bf16``/``fp16`` (DeepSpeed's
        half-precision weights) or ``fp32``."""
        if self.autocast:
            return "bf16-autocast"
        return str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")

    def _measure_allreduce(self, step_s: float) -> None:
        """Time one all-reduce of the gradient volume and keep the slowest rank's figures for this step.

        Every rank calls it at the same steps (:func:`is_sample_step`), so the collectives match.
        """
        world_size = self.plan.world_size
        comm_s = None
        if world_size > 1:
            if self._comm_buffer is None:
                self._comm_buffer = self.torch.zeros(self.n_trainable, dtype=self.torch.float32, device=self.device)
            comm_s = self.ds.time_all_reduce(self._comm_buffer, self.device)
            step_s, comm_s = self.ds.max_figures_across_ranks([step_s, comm_s], self.device)
        self.allreduce_samples.append(
            [self.step + 1, round(step_s * 1e3, 3), None if comm_s is None else round(comm_s * 1e3, 3)]
        )
        if self.step_log is not None and comm_s is not None and step_s > 0:
            self.step_log.record(self.step + 1, {"allreduce_share": comm_s / step_s})

    # --- resume ---------------------------------------------------------------------------------------------

    def _resume(self) -> None:
        checkpoints_dir = self.config.checkpoints_dir
        choice: tuple[int | None, str | None] = (None, None)
        if self.rank == 0:
            selected, skipped = select_resume_checkpoint(checkpoints_dir)
            for check in skipped:
                log.warning("skipping checkpoint %s: %s", check.path, check.reason)
            if selected is not None:
                problem = resume_refusal(
                    selected.path,
                    selected.manifest,
                    self.resume_key,
                    world_size=self.plan.world_size,
                    checkpoints_dir=checkpoints_dir,
                )
                choice = (None, problem) if problem else (selected.step, None)
        step, problem = self.ds.broadcast_from_rank0(choice)
        if problem:
            raise ResumeError(problem)
        if step is None:
            log.info("no complete checkpoint in %s: starting at step 0", checkpoints_dir)
            return
        path, client_state = self.engine.load_checkpoint(
            str(checkpoints_dir),
            tag=step_dir_name(step),
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise TrainingJobError(
                f"DeepSpeed could not load the verified checkpoint {checkpoints_dir}/step_{step}"
            )
        state = client_state["hybridtrain"]
        self.step = self.resumed_from = self.last_checkpoint = step
        self.loss_curve = state["loss_curve"]
        self.train_wall_prior_s = state["train_wall_s"]
        self.allreduce_samples = state.get("allreduce_samples", [])
        self.last_loss = self.loss_curve[-1][1] if self.loss_curve else None
        epoch, batch = divmod(step, self.plan.steps_per_epoch)
        log.info(
            "resumed from %s at step %d (epoch %d, skipping %d seen batches)",
            checkpoints_dir / step_dir_name(step),
            step,
            epoch,
            batch,
        )

    # --- checkpoints, evaluation, progress ------------------------------------------------------------------

    def _checkpoint(self, *, evaluate: bool) -> None:
        dist = self.torch.distributed
        step_dir = self.config.checkpoints_dir / step_dir_name(self.step)
        self._report("checkpointing", force=True)
        self.heartbeat.beat(phase="checkpointing")
        if evaluate:
            self.evaluation = self._evaluate()
            self._record_evaluation()
            self.heartbeat.beat(phase="checkpointing")
        if self.rank == 0 and step_dir.exists():
            log.warning("replacing %s, left by an earlier attempt", step_dir)
            remove_checkpoint(step_dir)
        dist.barrier()
        client_state = {
            "hybridtrain": {
                "step": self.step,
                "loss_curve": self.loss_curve,
                "train_wall_s": self._train_wall_s(),
                "allreduce_samples": self.allreduce_samples,
            }
        }
        started = time.monotonic()
        self.engine.save_checkpoint(
            str(self.config.checkpoints_dir),
            tag=step_dir_name(self.step),
            client_state=client_state,
            save_latest=False,
        )
        # Every rank's shards are written before rank 0 lists them for the manifest (DeepSpeed 0.19.8 ends
        # save_checkpoint with a barrier too; this one does not depend on it). Rank 0 then requires each file
        # any rank saw, so a shard its node does not show yet fails the save instead of being left out.
        dist.barrier()
        seen = self.ds.gather_objects(sorted(_files_under(step_dir)))
        if self.rank == 0:
            metrics = {"train_loss": self.last_loss}
            if evaluate and self.evaluation is not None:
                metrics |= {
                    "holdout_auc": self.evaluation["auc"],
                    "holdout_log_loss": self.evaluation["log_loss"],
                }
            manifest = build_manifest(
                step_dir,
                step=self.step,
                epoch=self.plan.epochs_completed(self.step),
                metrics=metrics,
                extra={
                    "run_id": self.config.run_id,
                    "total_steps": self.plan.total_steps,
                    "resume_key": self.resume_key,
                    "world_size": self.plan.world_size,
                    "deepspeed_version": self.deepspeed.__version__,
                },
                required={name for names in seen for name in names},
            )
            write_manifest(step_dir, manifest)
            size = sum(entry["size"] for entry in manifest["files"])
            log.info(
                "checkpoint %s: %d files, %.1f MB, %.2f s",
                step_dir,
                len(manifest["files"]),
                size / 1e6,
                time.monotonic() - started,
            )
            if self.config.keep_last_checkpoints:
                for old in checkpoints_to_prune(
                    self.config.checkpoints_dir, self.config.keep_last_checkpoints
                ):
                    log.info("pruning %s (keep_last_checkpoints=%d)", old, self.config.keep_last_checkpoints)
                    remove_checkpoint(old)
        self.last_checkpoint = self.step
        self._report("training", force=True)
        self.heartbeat.beat(phase="training")

    def _evaluate(self) -> dict[str, Any]:
        """Holdout AUC and log loss of the current weights, on every rank (a ZeRO-3 forward is collective)."""
        torch = self.torch
        self.heartbeat.beat(phase="evaluating")
        self.engine.eval()
        logits = []
        with torch.no_grad():
            for start in range(0, len(self.data.holdout_y), _EVAL_CHUNK_ROWS):
                chunk = torch.from_numpy(self.data.holdout_x[start : start + _EVAL_CHUNK_ROWS])
                output = self.engine(chunk.to(self.device, dtype=self.dtype)).float().squeeze(1)
                logits.append(output.cpu().numpy())
                self.heartbeat.beat()
        self.engine.train()
        scores = np.concatenate(logits).astype(np.float64)
        probabilities = 1.0 / (1.0 + np.exp(-scores))
        labels = self.data.holdout_y
        return {
            "step": self.step,
            "auc": roc_auc(labels, scores),
            "log_loss": log_loss(labels, probabilities),
            "rows": len(labels),
            "positives": int(labels.sum()),
        }

    def _record_loss(self, loss: float) -> None:
        if not np.isfinite(loss):
            raise TrainingJobError(
                f"training loss is {loss} at step {self.step}: the run diverged (lower learning_rate); the "
                f"last complete checkpoint is step {self.last_checkpoint}"
            )
        self.last_loss = loss
        self.loss_curve.append([self.step, round(loss, 6)])
        self.reporter.add_loss(loss)
        if self.step_log is not None:
            self.step_log.record(self.step, {"loss": loss}, with_rate=True)

    def _record_evaluation(self) -> None:
        if self.step_log is not None and self.evaluation is not None:
            self.step_log.record(self.step, {"holdout_auc": self.evaluation["auc"],
                                             "holdout_log_loss": self.evaluation["log_loss"]})
            self.step_log.restart_rate()  # the evaluation and the checkpoint are not training time

    def _report(self, state: str, force: bool = False) -> bool:
        if self.rank != 0:
            return False
        return self.reporter.update(
            state=state,
            step=self.step,
            force=force,
            epoch=self.plan.epochs_completed(self.step),
            last_checkpoint_step=self.last_checkpoint,
            resumed_from_step=self.resumed_from,
        )

    def _log_progress(self) -> None:
        fields = self.reporter.written
        log.info(
            "step %d/%d loss %s %s samples/s eta %s s",
            self.step,
            self.plan.total_steps,
            "-" if self.last_loss is None else f"{self.last_loss:.4f}",
            fields.get("samples_per_s", "-"),
            fields.get("eta_s", "-"),
        )

    def _train_wall_s(self) -> float:
        return round(self.train_wall_prior_s + time.monotonic() - self.loop_started, 3)

    # --- endings --------------------------------------------------------------------------------------------

    def _stop(self, stop_code: int) -> ExitCode:
        """Checkpoint (when this attempt made progress) and stop; requeue on SIGUSR2 under Slurm.

        :param stop_code: the highest :attr:`StopRequest.code` over all ranks.
        """
        signal_name = StopRequest.signal_for(stop_code).name
        log.warning("%s received: stopping at step %d", signal_name, self.step)
        if self.step > 0 and self.step != self.last_checkpoint:
            self._checkpoint(evaluate=False)
        self._report("stopped", force=True)
        if signal_name != "SIGUSR2":
            return ExitCode.TERMINATED
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            log.warning(
                "SLURM_JOB_ID is not set: not requeueing; run the same command again to resume from step %s",
                self.last_checkpoint,
            )
            return ExitCode.STOPPED
        if self.rank == 0:
            log.info("requeueing Slurm job %s", job_id)
            requeue_job(job_id)
        return ExitCode.OK

    def _finish(self) -> ExitCode:
        self.heartbeat.beat(phase="finishing")
        if self.evaluation is None or self.evaluation["step"] != self.step:
            self.evaluation = self._evaluate()
            self._record_evaluation()
            self.heartbeat.beat(phase="finishing")
        state_dict = self.ds.full_state_dict(self.engine)
        engine_outputs = self._probabilities((self.smoke_inputs - self.data.mean) / self.data.std)
        if self.rank == 0:
            with self.ds.torch_linear():
                exported = self.export_model(
                    state_dict,
                    spec=self.config.model,
                    mean=self.data.mean,
                    std=self.data.std,
                    feature_columns=self.data.feature_columns,
                    smoke_inputs=self.smoke_inputs,
                    export_dir=self.config.export_dir,
                    details={"run_id": self.config.run_id, "step": self.step, "model": self._model_details()},
                    precision_sample=self.precision_sample,
                    device=str(self.device),
                )
            exported["max_abs_diff_vs_engine"] = self._check_export(engine_outputs)
            write_json_atomic(self.config.run_dir / METRICS_FILE, self._metrics(exported))
            log.info(
                "finished at step %d: holdout AUC %s, log loss %.4f; metrics in %s",
                self.step,
                self.evaluation["auc"],
                self.evaluation["log_loss"],
                self.config.run_dir / METRICS_FILE,
            )
        self._report("completed", force=True)
        return ExitCode.OK

    def _probabilities(self, standardized: np.ndarray) -> np.ndarray:
        """The engine's probabilities for standardised rows (every rank: ZeRO-3 forward is collective)."""
        torch = self.torch
        self.engine.eval()
        with torch.no_grad():
            inputs = torch.from_numpy(np.ascontiguousarray(standardized, dtype=np.float32))
            logits = self.engine(inputs.to(self.device, dtype=self.dtype)).float()
        self.engine.train()
        return torch.sigmoid(logits).cpu().numpy()

    def _check_export(self, engine_outputs: np.ndarray) -> float:
        """How far the export's smoke outputs are from the engine's; a real difference fails the run."""
        smoke = json.loads((self.config.export_dir / SMOKE_FILE).read_text())
        difference = float(np.max(np.abs(np.array(smoke["outputs"]) - engine_outputs)))
        tolerance = _EXPORT_TOLERANCE[self.dtype == self.torch.float32]
        if not difference <= tolerance:
            raise TrainingJobError(
                f"the exported model differs from the trained engine by {difference:.2e} (> {tolerance}) on "
                f"the smoke rows: {self.config.export_dir} is not trustworthy"
            )
        return difference

    def _model_details(self) -> dict[str, Any]:
        return {
            "preset": self.config.model.preset,
            "hidden_sizes": list(self.config.model.hidden_sizes),
            "dropout": self.config.model.dropout,
            "n_parameters": self.n_parameters,
        }

    def _metrics(self, exported: dict[str, Any]) -> dict[str, Any]:
        config, plan, evaluation = self.config, self.plan, self.evaluation
        rows_processed = self.step * plan.rows_per_step
        train_wall_s = self._train_wall_s()
        gpu = summarise_gpu_metrics(read_run_gpu_metrics(config.run_dir))
        return {
            "status": "completed",
            "run_id": config.run_id,
            "labels": config.labels,
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "step": self.step,
            "total_steps": plan.total_steps,
            "steps_per_epoch": plan.steps_per_epoch,
            "epochs_completed": plan.epochs_completed(self.step),
            "restarts": self.restarts,
            "resumed_from_step": self.resumed_from,
            "holdout": {
                "auc": evaluation["auc"],
                "log_loss": evaluation["log_loss"],
                "rows": evaluation["rows"],
                "positives": evaluation["positives"],
                "fraction": config.holdout_fraction,
                "rule": HOLDOUT_RULE,
            },
            "train": {
                "rows": len(self.data.train_y),
                "positives": int(self.data.train_y.sum()),
                "final_loss": self.last_loss,
            },
            "loss_curve": [{"step": step, "loss": loss} for step, loss in self.loss_curve],
            "train_rows_processed": rows_processed,
            "train_tokens_processed": rows_processed,
            "token_definition": _TOKEN_DEFINITION,
            "train_wall_time_s": train_wall_s,
            "wall_time_s": round(time.monotonic() - self.job.started, 3),
            "time_split_s": self.heartbeat.phases.seconds(),  # rank 0's wall seconds per phase (this run)
            "samples_per_s": round(rows_processed / train_wall_s, 2) if train_wall_s > 0 else None,
            "gpu": gpu,
            "mean_gpu_utilization_pct": gpu["mean_utilization_pct"],
            "model": self._model_details(),
            "deepspeed": {
                "version": self.deepspeed.__version__,
                "zero_stage": config.zero_stage,
                "world_size": plan.world_size,
                "nodes": self.nodes,
                "ranks": self.ranks,
                "collective_timeout_s": config.collective_timeout_s,
                "config": str(config.deepspeed_config),
                "device": self.device.type,
                "dtype": str(self.dtype).removeprefix("torch."),
                "precision": self.precision_name,
                "requested_precision": config.precision,
                "gradient_clipping_by": "loop" if self.clip_norm else "deepspeed",
                "fused_optimizer": bool(((self.ds_config.get("optimizer") or {}).get("params") or {}).get("fused")),
            },
            "allreduce": summarise_allreduce(
                self.allreduce_samples,
                every_steps=config.allreduce_sample_every_steps,
                world_size=plan.world_size,
                elements=self.n_trainable,
            ),
            "code_version": code_version(),
            "torch_version": self.torch.__version__,
            "python_version": platform.python_version(),
            "hyperparameters": {
                "batch_size": config.batch_size,
                "micro_batch": plan.batch_size,
                "accumulation": plan.accumulation,
                "global_batch": plan.rows_per_step,
                "learning_rate": config.learning_rate,
                "epochs": config.epochs,
                "max_steps": config.max_steps,
                "seed": config.seed,
            },
            "data": {
                "features_root": config.features_root,
                "ds": list(config.ds),
                "rows_per_partition": self.data.rows_per_partition,
                "feature_columns": list(self.data.feature_columns),
                "sha256": self.data.fingerprint,
            },
            "checkpoint": {
                "step": self.last_checkpoint,
                "path": str(config.checkpoints_dir / step_dir_name(self.last_checkpoint)),
                "manifest": MANIFEST_NAME,
            },
            "export": exported,
        }


def _autocast(requested: str, device: Any, dtype: Any, torch: Any) -> bool:
    """Whether the loop runs the network under bf16 autocast: never over DeepSpeed's half-precision weights;
    ``bf16`` always; ``auto`` on a GPU that computes bf16 natively."""
    if dtype != torch.float32 or requested == "fp32":
        return False
    if requested == "bf16":
        return True
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def _slurm_cpus(environ: Mapping[str, str]) -> int | None:
    value = environ.get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _step_seed(seed: int, step: int, micro: int = 0) -> int:
    """The torch seed of one micro-batch (dropout), so a resumed step draws what the uninterrupted one would.
    The first micro-batch keeps the seed of the whole step before accumulation existed."""
    entropy = [seed, step] if micro == 0 else [seed, step, micro]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def _files_under(directory: Path) -> list[str]:
    """The files under ``directory`` as this process sees them, relative, in POSIX form."""
    return [path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()]


def main(
    argv: list[str] | None = None, *, started: float | None = None, stop: StopRequest | None = None
) -> int:
    """``python jobs/train.py --config <run config JSON>``; returns an :class:`ExitCode`.

    :param started: ``time.monotonic()`` when the process started, for ``wall_time_s``; default now.
    :param stop: the signal handlers, when installed already; default installs them now.
    """
    started = time.monotonic() if started is None else started
    if stop is None:
        stop = StopRequest()
        stop.install()
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run config JSON the operator wrote")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    logging.basicConfig(
        level=logging.INFO,
        format=log_format(rank, node_name(os.environ, platform.node())),
        stream=sys.stderr,
        force=True,
    )
    try:
        config = load_run_config(args.config)
    except TrainingJobError as error:
        log.error("%s", error)
        return error.exit_code
    config.run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainingJob(config, stop, started)
    try:
        return job.run()
    except TrainingJobError as error:
        log.error("%s", error)
        job.report_failure(error)
        return error.exit_code
    except Exception as error:
        log.exception("training failed")
        job.report_failure(error)
        return ExitCode.FAILED
