"""What the loop tells the outside while it trains, from rank 0: ``progress.json`` (``progress``), the progress
log line, and the step figures in ``step_metrics.jsonl`` and MLflow (``tracking``). On the other ranks the
writes are no-ops. Standard library only (and the modules named)."""

from __future__ import annotations

import logging

from hybridtrain.plan import TrainingPlan
from hybridtrain.progress import ProgressReporter
from hybridtrain.state import TrainingState
from hybridtrain.tracking import StepMetricsLog

__all__ = ["TrainingReports"]

log = logging.getLogger("hybridtrain")


class TrainingReports:
    """Reports ``state`` as the loop advances it.

    :param step_log: rank 0's step figures; None on the other ranks.
    """

    def __init__(self, *, rank: int, plan: TrainingPlan, state: TrainingState, progress: ProgressReporter,
                 step_log: StepMetricsLog | None) -> None:
        self.rank = rank
        self.plan = plan
        self.state = state
        self.progress = progress
        self.step_log = step_log

    def restart_rate(self) -> None:
        """Measure throughput from the current step on (start-up and resume are not training time)."""
        self.progress.restart_rate(self.state.step)

    def report(self, phase: str, force: bool = False) -> bool:
        """Rewrite ``progress.json`` in ``phase`` when due or forced (rank 0); whether it wrote."""
        if self.rank != 0:
            return False
        state = self.state
        return self.progress.update(
            state=phase,
            step=state.step,
            force=force,
            epoch=self.plan.epochs_completed(state.step),
            last_checkpoint_step=state.last_checkpoint,
            resumed_from_step=state.resumed_from,
        )

    def log_progress(self) -> None:
        """The progress log line, with the figures ``progress.json`` was just written with."""
        fields = self.progress.written
        log.info(
            "step %d/%d loss %s %s samples/s eta %s s",
            self.state.step,
            self.plan.total_steps,
            "-" if self.state.last_loss is None else f"{self.state.last_loss:.4f}",
            fields.get("samples_per_s", "-"),
            fields.get("eta_s", "-"),
        )

    def loss(self, loss: float) -> None:
        """A logged step's loss (already in ``state``)."""
        self.progress.add_loss(loss)
        if self.step_log is not None:
            self.step_log.record(self.state.step, {"loss": loss}, with_rate=True)

    def evaluation(self) -> None:
        """The holdout evaluation just made (``state.evaluation``)."""
        evaluation = self.state.evaluation
        if self.step_log is not None and evaluation is not None:
            self.step_log.record(self.state.step, {"holdout_auc": evaluation["auc"],
                                                   "holdout_log_loss": evaluation["log_loss"]})
            self.step_log.restart_rate()  # the evaluation and the checkpoint are not training time

    def allreduce_share(self, step: int, step_s: float, comm_s: float | None) -> None:
        """A measured step's share of all-reduce time (see ``allreduce``). A timed all-reduce that outlasted the
        whole step measured a stalled rank (descheduled on a busy host, after the barrier), not a share: it stays in
        metrics.json's series, whose median-based share it does not sway, and is no step figure."""
        if self.step_log is not None and comm_s is not None and 0 <= comm_s < step_s:
            self.step_log.record(step, {"allreduce_share": comm_s / step_s})

    def close(self) -> None:
        if self.step_log is not None:
            self.step_log.close()
