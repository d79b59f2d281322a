"""The Slurm orphan reconciler: cancels the suite's jobs whose task instance is no longer live, proves each cancel
from Slurm's own state, and tells on-call.

A job outlives its task when the task stops without the operator hearing of it: marked failed in the second or two
between its deferral and the triggerer starting its trigger (Airflow deletes the unstarted trigger without calling
``on_kill``), a worker killed outright, a DAG run deleted. The rules of which job is judged and how are in
:mod:`hybridflow.utils.reconcile`; this module joins them to the cluster (:class:`~hybridflow.hooks.slurm.SlurmHook`)
and to Airflow's task instances, read through the Task SDK (the execution API the task already talks to: no ORM, no
REST credentials).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.exceptions import SlurmJobFailed
from hybridflow.utils.reconcile import (
    ACTIVE_RUN_STATES,
    Decision,
    TaskLook,
    Verdict,
    judge,
    state_in,
    summary_line,
)
from hybridflow.utils.slurm_jobs import DEFAULT_DEPLOYMENT

if TYPE_CHECKING:
    from hybridflow.hooks.slurm import SlurmHook
    from hybridflow.notifiers.oncall import Alert
    from hybridflow.utils.slurm_jobs import SlurmJobKey

RUNBOOK = "include/runbooks/slurm-reconciler.md"
# scancel returns at once; the job is CANCELLED when its processes are gone (seconds; a node that does not let go
# takes longer, and is worth an alert).
CANCEL_WAIT_S = 30.0


def task_lookup(ti: Any) -> Callable[[SlurmJobKey], TaskLook]:
    """Looks a job's task instance up through the running task's ``ti`` (Task SDK ``get_task_states``, and
    ``get_dagrun_state`` for one without a state). An error of the API propagates: nothing is judged blind."""

    def look_up(key: SlurmJobKey) -> TaskLook:
        states = ti.get_task_states(dag_id=key.dag_id, task_ids=[key.task_id], run_ids=[key.run_id],
                                    map_index=key.map_index if key.map_index >= 0 else None)
        found, state = state_in(states, key)
        run_state = ti.get_dagrun_state(dag_id=key.dag_id, run_id=key.run_id) if found and state is None else None
        run_active = getattr(run_state, "value", run_state) in ACTIVE_RUN_STATES  # an enum of str, or its text
        return TaskLook(found=found, state=state, run_active=run_active)

    return look_up


@dataclass
class Reconciliation:
    """One pass over the cluster: each job's decision, its summary line, and what came of the cancels."""

    dry_run: bool
    grace_s: int
    user: str
    decisions: list[Decision] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    ended_first: list[str] = field(default_factory=list)
    not_cancelled: list[str] = field(default_factory=list)

    @property
    def to_cancel(self) -> list[Decision]:
        return [d for d in self.decisions if d.verdict is Verdict.CANCEL]

    def line_of(self, job_id: str) -> str:
        return next(line for line in self.lines if line.startswith(f"slurm job {job_id} "))

    def to_xcom(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "grace_s": self.grace_s, "user": self.user,
                "jobs": [d.to_dict() for d in self.decisions],
                "would_cancel": [d.job.job_id for d in self.to_cancel] if self.dry_run else [],
                "cancelled": self.cancelled, "ended_first": self.ended_first, "not_cancelled": self.not_cancelled}

    def alert(self, *, dag_id: str, run_id: str, task_id: str, try_number: int | None) -> Alert | None:
        """On-call's alert of what this pass cancelled, or failed to; None when it did neither (a dry run never
        alerts)."""
        from hybridflow.notifiers.oncall import ACTION, build_alert

        acted = self.cancelled + self.not_cancelled
        if not acted:
            return None
        what = f"cancelled {len(self.cancelled)} orphaned Slurm job(s) of the suite"
        if self.not_cancelled:
            what += f"; {len(self.not_cancelled)} NOT cancelled: {', '.join(self.not_cancelled)}"
        return build_alert(dag_id=dag_id, run_id=run_id, task_id=task_id, try_number=try_number, error=what,
                           job_id=",".join(acted), remote_log_tail="\n".join(map(self.line_of, acted)),
                           kind=ACTION)


def reconcile(hook: SlurmHook, look_up: Callable[[SlurmJobKey], TaskLook], *, grace_s: int, dry_run: bool,
              dag_ids: Collection[str] = (), deployment: str = DEFAULT_DEPLOYMENT,
              log: Callable[[str], None] = print,
              cancel_wait_s: float = CANCEL_WAIT_S) -> Reconciliation:
    """Lists the job user's jobs, judges each, then cancels (unless ``dry_run``) the ones to cancel and confirms
    each from the job's own state (scontrol, then sacct). Every job is judged before any is cancelled, so a lookup
    that fails ends the pass having changed nothing. Logs one summary line per job, and one per squeue line it
    could not read (left alone)."""
    listing = hook.user_jobs()
    result = Reconciliation(dry_run=dry_run, grace_s=grace_s, user=listing.user)
    result.decisions = [judge(job, user=listing.user, now_s=listing.now_s, grace_s=grace_s, look_up=look_up,
                              deployment=deployment,
                              dag_ids=dag_ids) for job in listing.jobs]
    for decision in result.decisions:
        outcome = ""
        if decision.verdict is Verdict.CANCEL:
            job_id = decision.job.job_id
            outcome = "dry run: not cancelled" if dry_run else _cancel(hook, job_id, result, cancel_wait_s)
        result.lines.append(summary_line(decision, outcome))
        log(result.lines[-1])
    for line in listing.unreadable:
        log(f"squeue line not understood, left alone: {line!r}")
    counts = {verdict: sum(d.verdict is verdict for d in result.decisions) for verdict in Verdict}
    log(f"reconciled {len(result.decisions)} job(s) of user {listing.user} (grace {grace_s} s"
        f"{', dry run' if dry_run else ''}): " + ", ".join(f"{v} {n}" for v, n in counts.items() if n)
        + f"; cancelled {len(result.cancelled)}, not cancelled {len(result.not_cancelled)}")
    return result


def _cancel(hook: SlurmHook, job_id: str, result: Reconciliation, wait_s: float) -> str:
    status = hook.cancel(job_id, wait_s=wait_s)
    if status is not None and status.state == "CANCELLED":
        result.cancelled.append(job_id)
        return f"CANCELLED (per {status.source})"
    if status is not None and status.final(requeue_enabled=False):
        result.ended_first.append(job_id)
        return f"ended {status.state} on its own before the cancel (per {status.source})"
    result.not_cancelled.append(job_id)
    state = "unknown to Slurm" if status is None else f"still {status.state} (per {status.source})"
    return f"NOT cancelled: {state} {wait_s:.0f} s after scancel"


def reconcile_cluster(ssh_conn_id: str, ti: Any, *, grace_s: int, dry_run: bool, dag_ids: Collection[str],
                      notifier) -> dict[str, Any]:
    """The reconciler DAG's task: one pass, an on-call alert when it cancelled something (or could not), and a
    failure when a cancel is not confirmed. Returns the pass for XCom."""
    from hybridflow.config import pipeline_config
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook(ssh_conn_id)
    try:
        result = reconcile(hook, task_lookup(ti), grace_s=grace_s, dry_run=dry_run, dag_ids=dag_ids,
                           deployment=pipeline_config().reconciler.deployment)
    finally:
        hook.close()
    alert = result.alert(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, try_number=ti.try_number)
    if alert is not None:
        notifier.send(alert)
    if result.not_cancelled:
        first, *others = result.not_cancelled
        also = f" (and {', '.join(others)})" if others else ""
        raise SlurmJobFailed(f"scancel did not end Slurm job {first}{also} within {CANCEL_WAIT_S:.0f} s; see the "
                             f"lines above. Runbook: {RUNBOOK}")
    return result.to_xcom()
