"""scripts/test_lanes.py's plan: every test in exactly one lane, what takes a shared service down beside nothing
that uses it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_lanes  # pytest puts scripts/ on sys.path (pythonpath in pyproject.toml)

REPO = Path(__file__).resolve().parents[3]
ASF = "tests/reliability/test_airflow_slurm_faults.py"
HEALS = "tests/integration/test_training_heals_itself.py"


def test_every_test_file_of_the_suite_runs_in_exactly_one_lane():
    files = test_lanes.test_files()
    lanes = test_lanes.plan(files)
    planned = [item for lane in test_lanes.LANES for item in lanes[lane]
               if not item.startswith("--") and "::" not in item]
    assert sorted(planned) == sorted(files) and len(set(planned)) == len(files)
    assert "tests/unit/scripts/test_test_lanes.py" in lanes["airflow"]
    assert len(files) > 100 and all(lanes[lane] for lane in test_lanes.LANES)


def test_a_test_placed_apart_from_its_file_runs_in_its_lane_and_is_deselected_from_its_files():
    lanes = test_lanes.plan(test_lanes.test_files())
    for test_id in test_lanes.single_tests():
        test_file, name = test_id.split("::")
        assert re.search(rf"^def {name}\(", (REPO / test_file).read_text(), re.M), f"{test_id} names no test"
        assert test_id in lanes[test_lanes.lane_of(test_id)]
        assert f"--deselect={test_id}" in lanes[test_lanes.lane_of(test_file)]
        assert sum(test_id in selection for selection in lanes.values()) == 1


def test_a_single_test_of_a_file_not_in_the_run_is_not_added():
    lanes = test_lanes.plan(["tests/unit/test_config.py"])
    assert lanes["airflow"] == ["tests/unit/test_config.py"]
    assert all(lanes[lane] == [] for lane in test_lanes.LANES if lane != "airflow")


@pytest.mark.parametrize(("test_id", "lane"), [
    ("tests/integration/test_triton_release.py", "triton"),
    ("tests/integration/test_workload_router.py", "triton"),
    ("tests/integration/test_release_approval.py", "triton"),
    ("tests/reliability/test_triton_faults.py", "triton-outages"),  # takes Triton down: beside no Triton user
    ("tests/reliability/test_triton_hostile_requests.py", "triton-outages"),  # kills tritonserver
    ("tests/integration/test_training_job.py", "local"),  # no service at all
    ("tests/integration/test_stack_smoke.py", "training"),
    ("tests/unit/test_config.py", "airflow"),
    ("tests/unit/a/new/test_folder.py", "airflow"),
    ("tests/integration/test_training_on_slurm.py", "training"),
    (f"{HEALS}::test_a_data_error_fails_at_once_without_a_requeue_or_a_retry", "training"),
    (HEALS, "control-plane"),  # a node dies, a node fails its self-check
    ("tests/browser/test_trigger_form.py", "airflow"),
    ("tests/integration/test_params_api.py", "airflow"),
    (ASF, "airflow"),  # the faults of its own task process
    (f"{ASF}::test_task_process_killed_again_and_again_always_reattaches_to_the_one_job", "airflow"),
    (f"{ASF}::test_sshd_down_30s_while_deferred_the_trigger_reconnects_and_the_task_succeeds", "ssh-airflow-mlflow"),
    (f"{ASF}::test_triggerer_restart_while_deferred_resumes_and_the_task_succeeds_on_the_same_job",
     "ssh-airflow-mlflow"),
    ("tests/reliability/test_load.py", "ssh-airflow-mlflow"),  # fills Airflow's slots and the GPU pool
    ("tests/integration/test_mlflow_server.py", "ssh-airflow-mlflow"),  # takes MLflow down and up
    ("tests/e2e/test_nightly_pipeline.py", "control-plane"),  # kills slurmctld, Airflow's components, PostgreSQL
    ("tests/integration/test_slurm_gates.py", "control-plane"),  # takes every GPU of the partition
    ("tests/integration/test_utilization_ledger.py", "control-plane"),  # drains a node
    ("tests/reliability/test_a_new_fault.py", "control-plane"),  # unlisted: beside only the local lane
    ("tests/integration/test_a_new_stage.py", "control-plane"),
    ("tests/integration/test_backfill_never_starts_a_night.py", "local"),  # an Airflow of its own on SQLite
    ("tests/integration/test_spark_stages.py", "local"),
    ("tests/reliability/test_data_faults.py", "local"),  # Spark on this machine
    ("tests/unit/jobs/hybridtrain/test_train_host_syncs.py", "local"),  # DeepSpeed in process
])
def test_lane_of(test_id, lane):
    assert test_lanes.lane_of(test_id) == lane


@pytest.mark.parametrize(("prefix", "test_id", "covered"), [
    ("tests/unit/", "tests/unit/test_x.py", True),
    ("tests/unit/", "tests/unitx/test_x.py", False),
    ("tests/a/test_x.py", "tests/a/test_x.py", True),
    ("tests/a/test_x.py", "tests/a/test_x.py::test_one", True),
    ("tests/a/test_x.py", "tests/a/test_x.pyc", False),
    ("tests/a/test_x.py::test_one", "tests/a/test_x.py", False),
    ("tests/a/test_x.py::test_one", "tests/a/test_x.py::test_one", True),
])
def test_covers(prefix, test_id, covered):
    assert test_lanes.covers(prefix, test_id) is covered


def test_every_lane_belongs_to_one_phase():
    lanes = [lane for phase in test_lanes.PHASES.values() for lane in phase]
    assert len(lanes) == len(set(lanes)) == len(test_lanes.LANES) and test_lanes.UNLISTED_LANE in lanes


@pytest.mark.parametrize(("args", "expected"), [
    (["--junitxml=/tmp/ci.xml", "-q"], ["--junitxml=/tmp/ci.triton.xml", "-q"]),
    (["--durations=40"], ["--durations=40"]),
    ([], []),
])
def test_each_lane_writes_its_own_report(args, expected):
    assert test_lanes.lane_args(args, "triton") == expected


@pytest.mark.parametrize(("codes", "expected"), [
    ({"triton": 0, "airflow": 0}, 0),
    ({"triton": 5, "airflow": 0}, 0),  # -k matched nothing in one lane
    ({"triton": 5, "airflow": 5}, 5),  # nothing collected anywhere: a broken selection
    ({"triton": 1, "airflow": 5}, 1),
    ({"triton": 0, "airflow": 2, "local": 1}, 2),
    ({}, 0),
])
def test_the_runs_exit_code(codes, expected):
    assert test_lanes.exit_code(codes) == expected


PYTEST_LOG = """\
tests/a.py .F.                                                        [100%]

=================================== FAILURES ===================================
_________________________________ test_short __________________________________

    def test_short():
>       assert 1 == 2
E       assert 1 == 2

tests/a.py:3: AssertionError
__ test_long_name_that_fills_the_terminal_line_to_its_end[case-1] ___
{long}
E       Failed: the release did not ask: {{'deploy_model': 'failed'}}

tests/b.py:9: Failed
----------------------------- Captured stdout call -----------------------------
a log line of the test, not its failure
=============================== warnings summary ===============================
tests/a.py::test_x
  DeprecationWarning: old
============================= slowest 25 durations =============================
1.00s call     tests/a.py::test_short
=========================== short test summary info ============================
SKIPPED [1] tests/c.py:4: root
FAILED tests/a.py::test_short - assert 1 == 2
FAILED tests/b.py::test_long_name_that_fills_the_terminal_line_to_its_end[case-1] - Failed: the release did not ask
= 2 failed, 1 passed in 3.00s =
""".format(long="\n".join(f"    line {i}" for i in range(100)))


def test_the_failure_digest_keeps_each_failures_end_and_the_summary_for_the_tail_ci_shows():
    digest = test_lanes.failure_digest(PYTEST_LOG, lines_per_failure=5).splitlines()
    assert digest == [
        "_________________________________ test_short __________________________________",
        "    def test_short():", ">       assert 1 == 2", "E       assert 1 == 2", "", "tests/a.py:3: AssertionError",
        "__ test_long_name_that_fills_the_terminal_line_to_its_end[case-1] ___",
        "[... 98 lines]", "    line 98", "    line 99",
        "E       Failed: the release did not ask: {'deploy_model': 'failed'}", "", "tests/b.py:9: Failed",
        "FAILED tests/a.py::test_short - assert 1 == 2",
        "FAILED tests/b.py::test_long_name_that_fills_the_terminal_line_to_its_end[case-1] - Failed: the release "
        "did not ask",
    ]


def test_the_failure_digest_of_a_log_without_failures_is_its_tail():
    log = "\n".join(f"[localstack] line {i}" for i in range(50)) + "\nERROR: slurmctld did not come up"
    assert test_lanes.failure_digest(log, lines_per_failure=3).splitlines() == [
        "[localstack] line 48", "[localstack] line 49", "ERROR: slurmctld did not come up"]


@pytest.mark.parametrize("argv, label", [
    (["/w/.venv/bin/python", "/w/.venv/bin/airflow", "scheduler", "--skip-serve-logs"], "python airflow scheduler"),
    (["/usr/bin/python3", "-m", "pytest", "tests/unit/", "--durations=25"], "python3 pytest"),
    (["/usr/lib/jvm/bin/java", "-cp", "/a:/b", "-Xmx1g", "org.apache.spark.deploy.worker.Worker", "--webui-port",
      "0"], "java Worker"),
    (["postgres: airflow airflow 127.0.0.1(50306) idle in transaction"], "postgres: airflow"),
    (["/v/bin/tritonserver", "--model-repository=/r"], "tritonserver"),
    (["python", "-c", "import json\nprint(1)", "arg"], "python import json arg"),
    ([""], ""),
])
def test_cpu_tally_labels_a_process_by_program_and_what_it_runs(argv, label):
    assert test_lanes.command_label(argv) == label
