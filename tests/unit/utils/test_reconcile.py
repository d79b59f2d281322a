"""The Slurm orphan reconciler's pure core: the job user's squeue, each job's task instance, and the decision,
by tables."""

from __future__ import annotations

import json

import pytest
from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.reconcile import (
    ListedJob,
    TaskLook,
    Verdict,
    judge,
    parse_cluster_clock,
    parse_user_jobs,
    state_in,
    summary_line,
    user_jobs_argv,
)
from hybridflow.utils.slurm_jobs import SlurmJobKey

RUN_ID = "scheduled__2026-12-01T02:00:00+00:00"
KEY = SlurmJobKey(dag_id="nightly_training", run_id=RUN_ID, task_id="training.train")
MAPPED = SlurmJobKey(dag_id="workload_router", run_id=RUN_ID, task_id="run_on_gpu_slurm", map_index=0)
RETRAIN = SlurmJobKey(dag_id="nightly_training", run_id=RUN_ID, task_id="training.train", retrain=2)
NOW = 1_796_324_771
GRACE = 300


def listed(key: SlurmJobKey | None = KEY, *, age_s: int = 3600, user: str = "mlops", state: str = "RUNNING",
           name: str | None = None, comment: str | None = None, job_id: str = "512") -> ListedJob:
    return ListedJob(job_id=job_id, user=user, state=state, submitted_s=NOW - age_s,
                     name=name if name is not None else key.job_name if key else "hf-by-hand",
                     comment=comment if comment is not None else (key.comment() if key else ""))


# --- squeue and the cluster's clock ---------------------------------------------------------------------------

def test_reconcile_squeue_argv_lists_one_user_with_epoch_submit_times():
    assert user_jobs_argv("mlops") == ["env", "SLURM_TIME_FORMAT=%s", "squeue", "--noheader", "--user=mlops", "-o",
                                       "%i|%u|%T|%V|%j|%k"]


@pytest.mark.parametrize("user", ["mlops", "svc_ml-01", "john.doe", "ml@corp.example", "0ps"])
def test_reconcile_squeue_argv_takes_posix_and_directory_user_names(user):
    assert user_jobs_argv(user)[4] == f"--user={user}"


@pytest.mark.parametrize("user", ["", "root;id", "--all", "-u", "a b", "x" * 65, "a\nb", None])
def test_reconcile_squeue_argv_refuses_what_is_not_a_user_name(user):
    with pytest.raises(ValueError, match="is not a user name"):
        user_jobs_argv(user)


@pytest.mark.parametrize("stdout, expected", [("1796324771\n", 1796324771), (" 0 ", 0)])
def test_reconcile_cluster_clock(stdout, expected):
    assert parse_cluster_clock(stdout) == expected


@pytest.mark.parametrize("stdout", ["", "Thu Dec  3 19:06:11 UTC 2026", "-1", "1.5", "date: invalid option"])
def test_reconcile_cluster_clock_refuses_anything_else(stdout):
    with pytest.raises(SlurmOutputParseError, match="expected epoch seconds"):
        parse_cluster_clock(stdout)


COMMENT = KEY.comment()
SQUEUE = (
    f"512|mlops|RUNNING|1796324000|{KEY.job_name}|{COMMENT}\n"
    "513|mlops|PENDING|1796324100|someone-elses-experiment|\n"
    "\n"
    "514_3|alice|RUNNING|1796324200|hf-looks-like-ours-0123456789abcdef|free text, with spaces\n"
)


def test_reconcile_parse_user_jobs_reads_every_field():
    jobs, unreadable = parse_user_jobs(SQUEUE)
    assert unreadable == []
    assert jobs == [
        ListedJob("512", "mlops", "RUNNING", 1796324000, KEY.job_name, COMMENT),
        ListedJob("513", "mlops", "PENDING", 1796324100, "someone-elses-experiment", ""),
        ListedJob("514_3", "alice", "RUNNING", 1796324200, "hf-looks-like-ours-0123456789abcdef",
                  "free text, with spaces"),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "515|mlops|RUNNING|1796324000|hf-a|b|c",  # a '|' in the name or comment: which field is which is a guess
        "516|mlops|RUNNING|1796324000|hf-a",  # a field short
        "517_[1-3]|mlops|PENDING|1796324000|hf-a|",  # a pending array: not one job
        "518|mlops|running|1796324000|hf-a|",  # not a Slurm state
        "519|mlops|RUNNING|2026-12-03T19:06:11|hf-a|",  # SLURM_TIME_FORMAT not applied
        "--all|mlops|RUNNING|1796324000|hf-a|",  # not a job id, never an scancel argument
    ],
    ids=["pipe-in-text", "short", "pending-array", "lower-case-state", "iso-time", "option-as-id"],
)
def test_reconcile_parse_user_jobs_sets_apart_lines_it_cannot_read(line):
    jobs, unreadable = parse_user_jobs(f"{line}\n512|mlops|RUNNING|1796324000|hf-b|\n")
    assert [job.job_id for job in jobs] == ["512"]
    assert unreadable == [line]


# --- the task instance from the Task SDK's get_task_states ---------------------------------------------------

@pytest.mark.parametrize(
    "states, key, expected",
    [
        ({RUN_ID: {"training.train": "deferred"}}, KEY, (True, "deferred")),
        ({RUN_ID: {"training.train": None}}, KEY, (True, None)),
        ({RUN_ID: {"training.evaluate": "running"}}, KEY, (False, None)),
        ({"manual__other": {"training.train": "running"}}, KEY, (False, None)),
        ({}, KEY, (False, None)),
        ({RUN_ID: {"run_on_gpu_slurm_0": "failed", "run_on_gpu_slurm_1": "running"}}, MAPPED, (True, "failed")),
        ({RUN_ID: {"run_on_gpu_slurm": "running"}}, MAPPED, (False, None)),
    ],
    ids=["found", "no-state-yet", "other-task", "other-run", "nothing", "mapped-index", "mapped-index-missing"],
)
def test_reconcile_state_in_task_states(states, key, expected):
    assert state_in(states, key) == expected


# --- the decision ---------------------------------------------------------------------------------------------

class Looks:
    """Task instances by key, as Airflow would answer; records which keys were asked for."""

    def __init__(self, looks: dict[SlurmJobKey, TaskLook] | None = None):
        self.looks = looks or {}
        self.asked: list[SlurmJobKey] = []

    def __call__(self, key: SlurmJobKey) -> TaskLook:
        self.asked.append(key)
        return self.looks.get(key, TaskLook(found=False))


def state(value: str | None, run_active: bool = False) -> TaskLook:
    return TaskLook(found=True, state=value, run_active=run_active)


OTHER_KEY = SlurmJobKey(dag_id="nightly_training", run_id=RUN_ID, task_id="evaluation.evaluate")


@pytest.mark.parametrize(
    "job, looks, verdict, ti, reason",
    [
        # a live task instance follows its job: never touched, whatever the age
        *[(listed(), {KEY: state(s)}, Verdict.KEEP, s, f"task instance is {s}")
          for s in ("scheduled", "queued", "running", "deferred", "up_for_retry", "up_for_reschedule", "restarting")],
        (listed(age_s=10**6), {KEY: state("deferred")}, Verdict.KEEP, "deferred", "task instance is deferred"),
        (listed(), {KEY: state(None, run_active=True)}, Verdict.KEEP, "none", "no state yet in an active DAG run"),
        # not live, past the grace: cancelled
        *[(listed(), {KEY: state(s)}, Verdict.CANCEL, s, f"task instance is {s} and the job is 3600 s old")
          for s in ("failed", "success", "skipped", "upstream_failed", "removed")],
        (listed(), {KEY: state(None, run_active=False)}, Verdict.CANCEL, "none", "task instance is none"),
        (listed(), {}, Verdict.CANCEL, "missing", "no such task instance and the job is 3600 s old (grace 300 s)"),
        (listed(age_s=GRACE), {}, Verdict.CANCEL, "missing", "300 s old"),
        (listed(MAPPED), {MAPPED: state("failed")}, Verdict.CANCEL, "failed", "task instance is failed"),
        (listed(RETRAIN), {RETRAIN: state("failed")}, Verdict.CANCEL, "failed", "task instance is failed"),
        (listed(state="PENDING"), {KEY: state("failed")}, Verdict.CANCEL, "failed", "task instance is failed"),
        # not live, but younger than the grace
        (listed(age_s=GRACE - 1), {KEY: state("failed")}, Verdict.TOO_YOUNG, "failed",
         "the job is 299 s old, under the grace of 300 s"),
        (listed(age_s=-5), {}, Verdict.TOO_YOUNG, "missing", "the job is 0 s old"),
        # not the suite's, or not judged: never touched, Airflow never asked
        (listed(user="alice"), {}, Verdict.FOREIGN, "", "user 'alice' is not the suite's job user 'mlops'"),
        (listed(name="someone-elses-experiment"), {}, Verdict.FOREIGN, "", "name does not start with 'hf-'"),
        (listed(None), {}, Verdict.UNKNOWN, "", "no job key in its comment"),
        (listed(comment="{not json"), {}, Verdict.UNKNOWN, "", "no job key in its comment"),
        (listed(comment=OTHER_KEY.comment()), {}, Verdict.UNKNOWN, "", "the key in its comment names another job"),
        (listed(name=KEY.job_name + "x"), {}, Verdict.UNKNOWN, "", "the key in its comment names another job"),
        (listed(state="COMPLETING"), {KEY: state("failed")}, Verdict.ENDING, "", "already COMPLETING"),
        (listed(state="CANCELLED"), {KEY: state("failed")}, Verdict.ENDING, "", "already CANCELLED"),
    ],
)
def test_reconcile_judge(job, looks, verdict, ti, reason):
    look_up = Looks(looks)
    decision = judge(job, user="mlops", now_s=NOW, grace_s=GRACE, look_up=look_up)
    assert (decision.verdict, decision.ti) == (verdict, ti), decision.reason
    assert reason in decision.reason
    judged = verdict in (Verdict.KEEP, Verdict.CANCEL, Verdict.TOO_YOUNG)
    assert look_up.asked == ([decision.key] if judged else [])


def test_reconcile_judge_only_the_dags_asked_for():
    looks = Looks()
    scoped = judge(listed(), user="mlops", now_s=NOW, grace_s=0, look_up=looks, dag_ids=["workload_router"])
    assert (scoped.verdict, scoped.reason, looks.asked) == (Verdict.OUT_OF_SCOPE, "its DAG is not in this run's "
                                                                                  "dag_ids", [])
    judged = judge(listed(), user="mlops", now_s=NOW, grace_s=0, look_up=looks, dag_ids=["nightly_training"])
    assert judged.verdict is Verdict.CANCEL and looks.asked == [KEY]


def test_reconcile_judge_another_deployments_job_is_foreign_and_airflow_is_never_asked():
    """Two Airflows sharing one job user (or a test's own Airflow beside the stack's): each judges only its own."""
    looks = Looks()
    theirs = judge(listed(), user="mlops", now_s=NOW, grace_s=0, look_up=looks, deployment="local-abc")
    assert (theirs.verdict, looks.asked) == (Verdict.FOREIGN, [])
    assert "submitted by Airflow deployment 'default', not 'local-abc'" in theirs.reason


def test_reconcile_judge_a_grace_of_zero_cancels_a_new_orphan_at_once():
    decision = judge(listed(age_s=0), user="mlops", now_s=NOW, grace_s=0, look_up=Looks({KEY: state("failed")}))
    assert decision.verdict is Verdict.CANCEL


def test_reconcile_summary_line_names_job_task_instance_state_and_decision():
    decision = judge(listed(MAPPED), user="mlops", now_s=NOW, grace_s=GRACE, look_up=Looks({MAPPED: state("failed")}))
    assert summary_line(decision, "CANCELLED (per scontrol)") == (
        f"slurm job 512 name={MAPPED.job_name} user=mlops state=RUNNING age=3600s dag=workload_router "
        f"run={RUN_ID} task=run_on_gpu_slurm[0] ti=failed decision=cancel: task instance is failed and the job is "
        "3600 s old (grace 300 s) -> CANCELLED (per scontrol)")
    foreign = judge(listed(name="x", comment=""), user="mlops", now_s=NOW, grace_s=GRACE, look_up=Looks())
    assert summary_line(foreign) == ("slurm job 512 name=x user=mlops state=RUNNING age=3600s dag=- run=- task=- "
                                     "ti=- decision=foreign: name does not start with 'hf-'")
    retrain = judge(listed(RETRAIN), user="mlops", now_s=NOW, grace_s=GRACE, look_up=Looks({RETRAIN: state("running")}))
    assert "task=training.train@retrain-2 ti=running decision=keep" in summary_line(retrain)


def test_reconcile_decision_to_dict_is_json_safe():
    decision = judge(listed(), user="mlops", now_s=NOW, grace_s=GRACE, look_up=Looks())
    assert json.loads(json.dumps(decision.to_dict())) == {
        "job_id": "512", "name": KEY.job_name, "user": "mlops", "state": "RUNNING", "age_s": 3600,
        "dag_id": "nightly_training", "run_id": RUN_ID, "task_id": "training.train", "map_index": -1,
        "ti_state": "missing", "decision": "cancel",
        "reason": "no such task instance and the job is 3600 s old (grace 300 s)"}
