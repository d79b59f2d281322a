"""The training job from start to finish: data, DeepSpeed, resume, the loop, checkpoints, evaluation, export.

Files under ``run_dir``: ``progress.json`` (see ``progress``), ``checkpoints/step_<n>/`` (see ``checkpoints``
and ``checkpointing``), ``metrics.json`` (see ``metrics``: written once training finished),
``gpu_metrics.rank<r>.jsonl`` (see ``gpu``), ``heartbeats/rank<r>.json`` (see ``heartbeat``),
``step_metrics.jsonl`` (rank 0's step figures, see ``tracking``), ``export/`` (see ``export``) and
``torch_extensions/`` (TORCH_EXTENSIONS_DIR, unless set: DeepSpeed builds nothing there unless a config asks for a
JIT op). Every rank writes its checkpoint shards, its own GPU samples and its heartbeat; only rank 0 writes the
others.

One optimizer step is ``gradient_accumulation_steps`` micro-batches of ``batch_size`` rows on every rank: the
loop calls ``engine.backward`` and ``engine.step`` per micro-batch, and DeepSpeed (0.19.8,
``runtime/engine.py``) divides each loss by the accumulation count in ``backward`` (``scale_wrt_gas``) and
steps the optimizer only at the accumulation boundary (``(micro_steps + 1) % gradient_accumulation_steps``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from hybridjobs.layout import METRICS_FILE, PROGRESS_FILE, STEP_METRICS_FILE
from hybridtrain.allreduce import is_sample_step
from hybridtrain.checkpoints import resume_key, write_json_atomic
from hybridtrain.config import RunConfig, deepspeed_settings_for_run, load_run_config, settings_for_device
from hybridtrain.errors import ExitCode, FeatureDataError, TrainingJobError, collective_failure
from hybridtrain.features import holdout_mask, read_feature_partitions, standardization
from hybridtrain.gpu import GpuSampler, bound_gpu_ids, gpu_metrics_file
from hybridtrain.heartbeat import Heartbeat
from hybridtrain.launch import (
    describe_ranks,
    distributed_environment,
    free_port,
    log_format,
    node_name,
    restart_count,
)
from hybridtrain.loop_window import LoopWindow
from hybridtrain.metrics import model_details, run_metrics
from hybridtrain.plan import TrainingPlan, epoch_permutation, make_plan
from hybridtrain.preemption import StopRequest, requeue_job
from hybridtrain.progress import ProgressReporter, read_progress
from hybridtrain.reporting import TrainingReports
from hybridtrain.state import TrainingState
from hybridtrain.tracking import open_step_log

__all__ = ["PreparedData", "TrainingJob", "main", "prepare_data"]

log = logging.getLogger("hybridtrain")

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
    """The part of an attempt that needs torch and DeepSpeed (imported here, after the config is valid): the
    engine and the training loop. Saving and resuming are ``checkpointing``'s, scoring with the engine is
    ``holdout``'s, what the loop reports is ``reporting``'s, and ``metrics.json`` is ``metrics``'."""

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
        from hybridtrain.checkpointing import Checkpointer
        from hybridtrain.export import PRECISION_SAMPLE_ROWS, SMOKE_ROWS
        from hybridtrain.holdout import EngineScorer
        from hybridtrain.model import build_network, count_parameters

        self.torch = torch
        self.deepspeed = deepspeed
        self.ds = ds_engine
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
        if self.clip_norm:
            ds_engine.clip_gradients_before_step(self.engine, self.clip_norm)
        self.dtype = ds_engine.input_dtype(ds_config)
        self.autocast = _autocast(self.config.precision, self.device, self.dtype, torch)
        self.control_group = ds_engine.control_group(self.device)
        self.ranks = ds_engine.gather_objects(
            {"rank": self.rank, "node": node_name(os.environ, platform.node()), "local_rank": self.local_rank}
        )
        self.nodes, placement = describe_ranks(self.ranks)
        log.info("ranks: %s", placement)
        job.reporter.fields["ranks"] = placement  # progress.json: the orchestrator's log names them too
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
        self.state = TrainingState()
        self.checkpointer = Checkpointer(
            self.engine,
            config=self.config,
            plan=plan,
            rank=self.rank,
            resume_key=resume_key(
                plan.as_dict(),
                data_sha256=data.fingerprint,
                hidden_sizes=self.config.model.hidden_sizes,
                dropout=self.config.model.dropout,
                zero_stage=self.config.zero_stage,
            ),
        )
        self.scorer = EngineScorer(self.engine, self.device, self.dtype, self.heartbeat)
        self.reports: TrainingReports | None = None  # from the loop's start: rank 0's step log opens there
        self.window = LoopWindow()
        self._comm_buffer: Any = None

    # --- main loop ------------------------------------------------------------------------------------------

    def train(self) -> ExitCode:
        torch, state = self.torch, self.state
        self.heartbeat.beat(phase="resuming")
        self.checkpointer.resume(state)
        # Every rank samples the GPU(s) Slurm bound to it, into its own file (see hybridtrain.gpu).
        sampler = GpuSampler(
            gpu_metrics_file(self.config.run_dir, self.rank),
            self.config.gpu_sample_every_s,
            rank=self.rank,
            gpu_ids=bound_gpu_ids(os.environ),
        )
        sampler.start()
        step_log = (
            open_step_log(self.config.run_dir / STEP_METRICS_FILE, self.plan.rows_per_step, self.config.tracking)
            if self.rank == 0
            else None
        )
        self.reports = reports = TrainingReports(
            rank=self.rank, plan=self.plan, state=state, progress=self.job.reporter, step_log=step_log
        )
        try:
            state.start_loop()
            reports.restart_rate()
            reports.report("training", force=True)
            self.heartbeat.beat(step=state.step, phase="training")
            loss_sum = torch.zeros((), device=self.device)
            losses = 0
            self.engine.train()
            while state.step < self.plan.total_steps:
                stop_code = self.ds.max_across_ranks(self.job.stop.code, self.control_group)
                if stop_code:
                    return self._stop(stop_code)
                measure = is_sample_step(state.step, self.config.allreduce_sample_every_steps)
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
                state.step += 1
                self.heartbeat.beat(step=state.step)
                if state.step % self.config.log_every_steps == 0 or state.step == self.plan.total_steps:
                    loss = self.ds.mean_across_ranks(loss_sum / losses)
                    self.window.mark(state.step)  # the loss read waited for every step so far
                    state.record_loss(loss)
                    reports.loss(loss)
                    loss_sum.zero_()
                    losses = 0
                if state.step % self.config.checkpoint_every_steps == 0 or state.step == self.plan.total_steps:
                    self._checkpoint(evaluate=True)
                elif reports.report("training"):
                    reports.log_progress()
            state.end_loop()
            return self._finish()
        finally:
            sampler.stop()
            reports.close()

    def _micro_step(self, micro: int) -> Any:
        """Forward and backward of micro-batch ``micro`` of the current step, and ``engine.step``; the loss."""
        torch, step = self.torch, self.state.step
        epoch, start = self.plan.batch_position(step, self.rank, micro)
        if self._order is None or self._order[0] != epoch:
            order = torch.from_numpy(epoch_permutation(self.plan.n_train_rows, self.plan.seed, epoch).copy())
            if self.device.type == "cuda":
                order = order.pin_memory()  # a copy from pageable memory would wait for the GPU's queue
            self._order = (epoch, order.to(self.device, non_blocking=True))
        rows = self._order[1][start : start + self.plan.batch_size]
        inputs = self.train_x.index_select(0, rows)
        labels = self.train_y.index_select(0, rows)
        torch.manual_seed(_step_seed(self.config.seed, step, micro))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.engine(inputs).squeeze(1).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.engine.backward(loss)
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
                # Untimed: the first all-reduce of a new buffer pays the backend's set-up, which once made a
                # sampled "share" of a step 1.22 (the all-reduce alone slower than the whole step).
                self.ds.time_all_reduce(self._comm_buffer, self.device)
            comm_s = self.ds.time_all_reduce(self._comm_buffer, self.device)
            step_s, comm_s = self.ds.max_figures_across_ranks([step_s, comm_s], self.device)
        step = self.state.step + 1
        self.state.allreduce_samples.append(
            [step, round(step_s * 1e3, 3), None if comm_s is None else round(comm_s * 1e3, 3)]
        )
        self.reports.allreduce_share(step, step_s, comm_s)

    # --- checkpoints and evaluation -------------------------------------------------------------------------

    def _checkpoint(self, *, evaluate: bool) -> None:
        self.ds.synchronize(self.device)  # the steps end here, not inside the checkpoint
        self.window.pause(self.state.step)
        self.reports.report("checkpointing", force=True)
        self.heartbeat.beat(phase="checkpointing")
        if evaluate:
            self._evaluate()
            self.heartbeat.beat(phase="checkpointing")
        self.checkpointer.save(self.state, with_evaluation=evaluate)
        self.window.mark(self.state.step)
        self.reports.report("training", force=True)
        self.heartbeat.beat(phase="training")

    def _evaluate(self) -> None:
        """Evaluate the current weights on the holdout, on every rank (a ZeRO-3 forward is collective)."""
        self.state.evaluation = self.scorer.evaluate(self.state.step, self.data.holdout_x, self.data.holdout_y)
        self.reports.evaluation()

    # --- endings --------------------------------------------------------------------------------------------

    def _stop(self, stop_code: int) -> ExitCode:
        """Checkpoint (when this attempt made progress) and stop; requeue on SIGUSR2 under Slurm.

        :param stop_code: the highest :attr:`StopRequest.code` over all ranks.
        """
        state = self.state
        signal_name = StopRequest.signal_for(stop_code).name
        log.warning("%s received: stopping at step %d", signal_name, state.step)
        if state.step > 0 and state.step != state.last_checkpoint:
            self._checkpoint(evaluate=False)
        self.reports.report("stopped", force=True)
        if signal_name != "SIGUSR2":
            return ExitCode.TERMINATED
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            log.warning(
                "SLURM_JOB_ID is not set: not requeueing; run the same command again to resume from step %s",
                state.last_checkpoint,
            )
            return ExitCode.STOPPED
        if self.rank == 0:
            log.info("requeueing Slurm job %s", job_id)
            requeue_job(job_id)
        return ExitCode.OK

    def _finish(self) -> ExitCode:
        from hybridtrain.export import difference_from_engine, export_model

        state, config = self.state, self.config
        self.heartbeat.beat(phase="finishing")
        if state.evaluation is None or state.evaluation["step"] != state.step:
            self._evaluate()
            self.heartbeat.beat(phase="finishing")
        state_dict = self.ds.full_state_dict(self.engine)
        engine_outputs = self.scorer.probabilities((self.smoke_inputs - self.data.mean) / self.data.std)
        if self.rank == 0:
            with self.ds.torch_linear():
                exported = export_model(
                    state_dict,
                    spec=config.model,
                    mean=self.data.mean,
                    std=self.data.std,
                    feature_columns=self.data.feature_columns,
                    smoke_inputs=self.smoke_inputs,
                    export_dir=config.export_dir,
                    details={"run_id": config.run_id, "step": state.step,
                             "model": model_details(config, self.n_parameters)},
                    precision_sample=self.precision_sample,
                    device=str(self.device),
                )
            exported["max_abs_diff_vs_engine"] = difference_from_engine(
                config.export_dir, engine_outputs, engine_float32=self.dtype == self.torch.float32
            )
            write_json_atomic(config.run_dir / METRICS_FILE, self._metrics(exported))
            log.info(
                "finished at step %d: holdout AUC %s, log loss %.4f; metrics in %s",
                state.step,
                state.evaluation["auc"],
                state.evaluation["log_loss"],
                config.run_dir / METRICS_FILE,
            )
        self.reports.report("completed", force=True)
        return ExitCode.OK

    def _metrics(self, exported: dict[str, Any]) -> dict[str, Any]:
        return run_metrics(
            config=self.config,
            plan=self.plan,
            data=self.data,
            state=self.state,
            restarts=self.restarts,
            wall_time_s=round(time.monotonic() - self.job.started, 3),
            time_split_s=self.heartbeat.phases.seconds(),  # rank 0's wall seconds per phase (this run)
            loop=self.window,
            n_parameters=self.n_parameters,
            n_trainable=self.n_trainable,
            engine={
                "version": self.deepspeed.__version__,
                "nodes": self.nodes,
                "ranks": self.ranks,
                "device": self.device.type,
                "dtype": str(self.dtype).removeprefix("torch."),
                "precision": self.precision_name,
                "gradient_clipping_by": "loop" if self.clip_norm else "deepspeed",
                "fused_optimizer": bool(((self.ds_config.get("optimizer") or {}).get("params") or {}).get("fused")),
            },
            torch_version=self.torch.__version__,
            exported=exported,
        )


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
