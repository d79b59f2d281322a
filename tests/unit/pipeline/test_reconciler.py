"""The reconciler's pass (hybridflow.pipeline.reconciler): every job judged before any is cancelled, dry runs cancel
nothing, cancels counted only when Slurm's own state says CANCELLED, and the on-call alert of what was cancelled.

``FakeSlurm`` is a double at the SSH boundary (the hook's ``user_jobs`` and ``cancel``); the real hook, squeue and
scancel run in tests/integration/test_slurm_reconciler.py. Everything behind the boundary is real.
"""

from __future__ import annotations

import pytest
from hybridflow.exceptions import SlurmJobFailed
from hybridflow.pipeline.reconciler import reconcile, reconcile_cluster, task_lookup
from hybridflow.utils.reconcile import JobListing, ListedJob, TaskLook
from hybridflow.utils.slurm_jobs import SlurmJobKey, SlurmJobStatus

# Job keys carry the Airflow deployment from the environment: a session beside the stack has the stack's.
pytestmark = pytest.mark.usefixtures("default_deployment")

RUN_ID = "scheduled__2026-12-01T02:00:00+00:00"
NOW = 1_796_324_771
FAILED = SlurmJobKey("nightly_training", RUN_ID, "training.train")
GONE = SlurmJobKey("nightly_training", "manual__deleted", "training.train")
LIVE = SlurmJobKey("nightly_training", RUN_ID, "evaluation.evaluate")


def job(job_id: str, key: SlurmJobKey | None, name: str = "") -> ListedJob:
    return ListedJob(job_id=job_id, user="mlops", state="RUNNING", submitted_s=NOW - 3600,
                     name=key.job_name if key else name, comment=key.comment() if key else "(null)")


class FakeSlurm:
    def __init__(self, jobs, after_cancel: dict[str, str | None] | None = None):
        self.listing = JobListing(user="mlops", now_s=NOW, jobs=tuple(jobs), unreadable=("7_[1-3]|mlops|...",))
        self.after_cancel = after_cancel or {}
        self.cancelled: list[str] = []

    def user_jobs(self) -> JobListing:
        return self.listing

    def cancel(self, job_id: str, wait_s: float) -> SlurmJobStatus | None:
        self.cancelled.append(job_id)
        state = self.after_cancel.get(job_id, "CANCELLED")
        return None if state is None else SlurmJobStatus(job_id=job_id, name="", state=state, source="scontrol")

    def close(self) -> None:
        pass


JOBS = [job("1", FAILED), job("2", GONE), job("3", LIVE), job("4", None, "someone-elses")]
LOOKS = {FAILED: TaskLook(True, "failed"), LIVE: TaskLook(True, "deferred")}


def run(slurm: FakeSlurm, dry_run: bool = False, looks=LOOKS):
    lines: list[str] = []
    result = reconcile(slurm, lambda key: looks.get(key, TaskLook(False)), grace_s=300, dry_run=dry_run,
                       log=lines.append)
    return result, lines


def test_reconciler_pass_cancels_orphans_only_and_logs_a_line_per_job():
    slurm = FakeSlurm(JOBS)
    result, lines = run(slurm)
    assert slurm.cancelled == ["1", "2"] and result.cancelled == ["1", "2"]
    assert [line.split(" decision=")[1].split(":")[0] for line in lines[:4]] == ["cancel", "cancel", "keep",
                                                                                  "foreign"]
    assert lines[0].endswith("-> CANCELLED (per scontrol)")
    assert lines[4] == "squeue line not understood, left alone: '7_[1-3]|mlops|...'"
    assert lines[5] == ("reconciled 4 job(s) of user mlops (grace 300 s): cancel 2, keep 1, foreign 1; "
                        "cancelled 2, not cancelled 0")
    assert result.to_xcom()["cancelled"] == ["1", "2"] and result.to_xcom()["would_cancel"] == []


def test_reconciler_dry_run_cancels_nothing_and_does_not_alert():
    slurm = FakeSlurm(JOBS)
    result, lines = run(slurm, dry_run=True)
    assert slurm.cancelled == [] and result.to_xcom()["would_cancel"] == ["1", "2"]
    assert lines[0].endswith("-> dry run: not cancelled")
    assert result.alert(dag_id="slurm_reconciler", run_id="r", task_id="reconcile", try_number=1) is None


def test_reconciler_judges_every_job_before_cancelling_any():
    def look_up(key):
        if key == GONE:
            raise ConnectionError("execution API unreachable")
        return LOOKS.get(key, TaskLook(False))

    slurm = FakeSlurm(JOBS)
    with pytest.raises(ConnectionError):
        reconcile(slurm, look_up, grace_s=300, dry_run=False, log=lambda line: None)
    assert slurm.cancelled == []


@pytest.mark.parametrize(
    "after, cancelled, ended_first, not_cancelled, outcome",
    [
        ("CANCELLED", ["1"], [], [], "-> CANCELLED (per scontrol)"),
        ("COMPLETED", [], ["1"], [], "-> ended COMPLETED on its own before the cancel (per scontrol)"),
        ("RUNNING", [], [], ["1"], "-> NOT cancelled: still RUNNING (per scontrol) 30 s after scancel"),
        (None, [], [], ["1"], "-> NOT cancelled: unknown to Slurm 30 s after scancel"),
    ],
)
def test_reconciler_counts_a_cancel_only_when_slurm_says_cancelled(after, cancelled, ended_first, not_cancelled,
                                                                   outcome):
    result, lines = run(FakeSlurm([job("1", FAILED)], {"1": after}))
    assert (result.cancelled, result.ended_first, result.not_cancelled) == (cancelled, ended_first, not_cancelled)
    assert lines[0].endswith(outcome)


class FakeNotifier:
    def __init__(self):
        self.sent = []

    def send(self, alert) -> None:
        self.sent.append(alert)


class FakeTaskInstance:
    """The Task SDK's task instance, at the execution API boundary: answers get_task_states and get_dagrun_state."""

    dag_id, run_id, task_id, try_number = "slurm_reconciler", "scheduled__2026-12-02T03:15:00+00:00", "reconcile", 1

    def __init__(self, states: dict, run_states: dict | None = None):
        self.states, self.run_states, self.asked = states, run_states or {}, []

    def get_task_states(self, dag_id, task_ids, run_ids, map_index=None):
        self.asked.append((dag_id, tuple(task_ids), tuple(run_ids), map_index))
        return {run_id: {task: state for (run, task), state in self.states.items() if run == run_id}
                for run_id in run_ids}

    def get_dagrun_state(self, dag_id, run_id):
        return self.run_states[run_id]


@pytest.mark.parametrize(
    "states, run_states, expected",
    [
        ({(RUN_ID, "training.train"): "running"}, {}, TaskLook(True, "running")),
        ({(RUN_ID, "training.train"): None}, {RUN_ID: "running"}, TaskLook(True, None, run_active=True)),
        ({(RUN_ID, "training.train"): None}, {RUN_ID: "failed"}, TaskLook(True, None, run_active=False)),
        ({}, {}, TaskLook(False)),
    ],
    ids=["state", "no-state-active-run", "no-state-ended-run", "missing"],
)
def test_reconciler_task_lookup_through_the_task_sdk(states, run_states, expected):
    ti = FakeTaskInstance(states, run_states)
    assert task_lookup(ti)(FAILED) == expected
    assert ti.asked == [("nightly_training", ("training.train",), (RUN_ID,), None)]


def test_reconciler_task_lookup_of_a_mapped_task_asks_for_its_index():
    ti = FakeTaskInstance({(RUN_ID, "route_4"): "failed"})
    assert task_lookup(ti)(SlurmJobKey("d", RUN_ID, "route", map_index=4)) == TaskLook(True, "failed")
    assert ti.asked == [("d", ("route",), (RUN_ID,), 4)]


def test_reconciler_task_alerts_on_cancels_and_fails_on_a_cancel_not_confirmed(monkeypatch):
    slurm = FakeSlurm(JOBS, {"2": "RUNNING"})
    monkeypatch.setattr("hybridflow.hooks.slurm.SlurmHook", lambda conn_id: slurm)
    notifier = FakeNotifier()
    ti = FakeTaskInstance({(RUN_ID, "training.train"): "failed", (RUN_ID, "evaluation.evaluate"): "deferred"})
    with pytest.raises(SlurmJobFailed, match="scancel did not end Slurm job 2 within 30 s"):
        reconcile_cluster("slurm_ssh", ti, grace_s=300, dry_run=False, dag_ids=[], notifier=notifier)
    (alert,) = notifier.sent
    assert (alert.kind, alert.dag_id, alert.stage, alert.job_id) == ("action", "slurm_reconciler",
                                                                      "slurm_reconciler", "1,2")
    assert alert.error == "cancelled 1 orphaned Slurm job(s) of the suite; 1 NOT cancelled: 2"
    assert alert.log_tail.splitlines()[0].startswith("slurm job 1 name=")
    assert "-> NOT cancelled: still RUNNING" in alert.log_tail.splitlines()[1]
