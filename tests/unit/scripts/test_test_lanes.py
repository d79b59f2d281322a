"""scripts/test_lanes.py's plan: every test file in exactly one lane, the disruptive ones alone."""

from __future__ import annotations

import pytest
import test_lanes  # pytest puts scripts/ on sys.path (pythonpath in pyproject.toml)


def test_every_test_file_of_the_suite_runs_in_exactly_one_lane():
    files = test_lanes.test_files()
    lanes = test_lanes.plan(files)
    planned = [f for lane in test_lanes.LANES for f in lanes[lane]]
    assert sorted(planned) == sorted(files) and len(set(planned)) == len(files)
    assert "tests/unit/scripts/test_test_lanes.py" in lanes["serving"]
    assert len(files) > 100 and all(lanes[lane] for lane in test_lanes.LANES)


@pytest.mark.parametrize(("test_file", "lane"), [
    ("tests/reliability/test_triton_faults.py", "alone"),  # takes Triton down
    ("tests/reliability/test_a_new_fault.py", "alone"),  # any new reliability test too
    ("tests/integration/test_stack_smoke.py", "alone"),  # kills Airflow's triggerer
    ("tests/integration/test_mlflow_server.py", "alone"),  # takes MLflow down and up
    ("tests/integration/test_triton_release.py", "serving"),
    ("tests/integration/test_training_job.py", "serving"),
    ("tests/unit/test_config.py", "serving"),
    ("tests/e2e/test_nightly_pipeline.py", "cluster"),
    ("tests/integration/test_slurm_gates.py", "cluster"),  # takes every GPU of the partition
    ("tests/integration/test_a_new_stage.py", "cluster"),  # unlisted: beside serving, never beside alone
    ("tests/browser/test_trigger_form.py", "cluster"),
    ("tests/integration/test_release_approval.py", "cluster"),  # runs on the stack's Airflow, as the e2e tests
    ("tests/integration/test_params_api.py", "cluster"),
])
def test_lane_of_a_file(test_file, lane):
    assert test_lanes.lane_of(test_file) == lane


@pytest.mark.parametrize(("args", "expected"), [
    (["--junitxml=/tmp/ci.xml", "-q"], ["--junitxml=/tmp/ci.serving.xml", "-q"]),
    (["--durations=40"], ["--durations=40"]),
    ([], []),
])
def test_each_lane_writes_its_own_report(args, expected):
    assert test_lanes.lane_args(args, "serving") == expected
