"""Saving and resuming the DeepSpeed engine's checkpoints: the sequence of collectives every rank runs, and the
manifest and pruning rank 0 does (the files and their verification: ``checkpoints``).

Every rank calls :meth:`Checkpointer.save` and :meth:`Checkpointer.resume` at the same point of the loop: both
hold collectives (barriers, a gather, a broadcast) that deadlock if one rank skips or reorders them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch.distributed as dist
from hybridtrain import engine as ds_engine
from hybridtrain.checkpoints import (
    build_manifest,
    checkpoints_to_prune,
    files_under,
    remove_checkpoint,
    resume_refusal,
    select_resume_checkpoint,
    step_dir_name,
    write_manifest,
)
from hybridtrain.config import RunConfig
from hybridtrain.errors import ResumeError, TrainingJobError
from hybridtrain.plan import TrainingPlan
from hybridtrain.state import TrainingState

__all__ = ["Checkpointer"]

log = logging.getLogger("hybridtrain")


class Checkpointer:
    """One rank's side of the run's checkpoints under ``config.checkpoints_dir``.

    :param resume_key: what a checkpoint must share with this run to be resumed (``checkpoints.resume_key``).
    """

    def __init__(self, engine: Any, *, config: RunConfig, plan: TrainingPlan, rank: int,
                 resume_key: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.plan = plan
        self.rank = rank
        self.resume_key = resume_key

    def resume(self, state: TrainingState) -> None:
        """Load the newest complete checkpoint rank 0 accepts into the engine and ``state``; none: step 0.

        :raises ResumeError: the newest complete checkpoint belongs to another run or world size.
        """
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
        step, problem = ds_engine.broadcast_from_rank0(choice)  # every rank loads what rank 0 verified
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
        state.resume(step, client_state)
        epoch, batch = divmod(step, self.plan.steps_per_epoch)
        log.info(
            "resumed from %s at step %d (epoch %d, skipping %d seen batches)",
            checkpoints_dir / step_dir_name(step),
            step,
            epoch,
            batch,
        )

    def save(self, state: TrainingState, *, with_evaluation: bool) -> None:
        """Save the checkpoint of ``state.step``, replacing one an earlier attempt left at that step.

        :param with_evaluation: ``state.evaluation`` is of this step: its figures go into the manifest.
        """
        step_dir = self.config.checkpoints_dir / step_dir_name(state.step)
        if self.rank == 0 and step_dir.exists():
            log.warning("replacing %s, left by an earlier attempt", step_dir)
            remove_checkpoint(step_dir)
        dist.barrier()  # nobody writes into the directory before rank 0 cleared it
        client_state = state.client_state()
        started = time.monotonic()
        self.engine.save_checkpoint(
            str(self.config.checkpoints_dir),
            tag=step_dir_name(state.step),
            client_state=client_state,
            save_latest=False,
        )
        # Every rank's shards are written before rank 0 lists them for the manifest (DeepSpeed 0.19.8 ends
        # save_checkpoint with a barrier too; this one does not depend on it). Rank 0 then requires each file
        # any rank saw, so a shard its node does not show yet fails the save instead of being left out.
        dist.barrier()
        seen = ds_engine.gather_objects(sorted(files_under(step_dir)))
        if self.rank == 0:
            self._write_manifest(step_dir, state, with_evaluation, required={n for names in seen for n in names},
                                 started=started)
            self._prune()
        state.last_checkpoint = state.step

    def _write_manifest(self, step_dir: Path, state: TrainingState, with_evaluation: bool, *,
                        required: set[str], started: float) -> None:
        metrics = {"train_loss": state.last_loss}
        if with_evaluation and state.evaluation is not None:
            metrics |= {
                "holdout_auc": state.evaluation["auc"],
                "holdout_log_loss": state.evaluation["log_loss"],
            }
        manifest = build_manifest(
            step_dir,
            step=state.step,
            epoch=self.plan.epochs_completed(state.step),
            metrics=metrics,
            extra={
                "run_id": self.config.run_id,
                "total_steps": self.plan.total_steps,
                "resume_key": self.resume_key,
                "world_size": self.plan.world_size,
                "deepspeed_version": deepspeed.__version__,
            },
            required=required,
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

    def _prune(self) -> None:
        keep = self.config.keep_last_checkpoints
        if keep:
            for old in checkpoints_to_prune(self.config.checkpoints_dir, keep):
                log.info("pruning %s (keep_last_checkpoints=%d)", old, keep)
                remove_checkpoint(old)
