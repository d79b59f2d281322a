"""The stall watch from the config or a run's params to the trigger, and the job's collective timeout above it: the
training operator's settings default to pipeline.yaml's, rendered params arrive as numbers, a bad one is named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridflow.config import load_pipeline_config
from hybridflow.exceptions import InvalidJobSpecError
from hybridflow.operators.training import DeepSpeedTrainingOperator

RUN_DIR = "/data/runs/nightly_training/ds=2026-01-02/run"
TEMPLATED = {name: "{{ params." + name + " }}"
             for name in ("stall_timeout_s", "stall_floor_s", "stall_factor", "stall_warm_up_steps")}


def make_operator(**kwargs) -> DeepSpeedTrainingOperator:
    return DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir=RUN_DIR, python="/venv/bin/python",
                                     jobs_dir="/jobs", partition="gpu-training", nodes=2, gpus_per_node=1, **kwargs)


def context_for(op, params=None) -> dict:
    ti = SimpleNamespace(dag_id="nightly_training", task_id=op.task_id, map_index=-1, run_id="manual__x")
    return {"ti": ti, "params": params or {}}


def trigger_kwargs(op) -> dict:
    op.job_id, op._context = "7", context_for(op)
    return op._trigger().serialize()[1]


def test_the_training_watch_defaults_to_the_pipeline_config():
    recovery = load_pipeline_config().recovery
    kwargs = trigger_kwargs(make_operator())
    assert {key: kwargs[key] for key in TEMPLATED} == {key: getattr(recovery, key) for key in TEMPLATED}
    assert kwargs["heartbeat_dir"] == f"{RUN_DIR}/heartbeats" and kwargs["world_size"] == 2


def test_a_runs_params_reach_the_trigger_as_numbers():
    op = make_operator(**TEMPLATED)
    op.render_template_fields(context_for(op, {"stall_timeout_s": 600.0, "stall_floor_s": 45.0, "stall_factor": 20,
                                               "stall_warm_up_steps": 8}))
    kwargs = trigger_kwargs(op)
    assert {key: kwargs[key] for key in TEMPLATED} == {"stall_timeout_s": 600.0, "stall_floor_s": 45.0,
                                                       "stall_factor": 20.0, "stall_warm_up_steps": 8}


def test_a_bad_setting_is_refused_naming_it():
    op = make_operator(**TEMPLATED)
    op.render_template_fields(context_for(op, {"stall_timeout_s": 900, "stall_floor_s": 1, "stall_factor": 10,
                                               "stall_warm_up_steps": 5}))
    with pytest.raises(InvalidJobSpecError, match=r"^stall_floor_s='1' is invalid: use a number from 10 to 3600"):
        op.stall_watch  # noqa: B018


def test_no_watch_without_a_stall_timeout():
    kwargs = trigger_kwargs(make_operator(stall_timeout_s=0))
    assert kwargs["heartbeat_dir"] == "" and kwargs["stall_timeout_s"] == 0.0


@pytest.mark.parametrize("given, timeout_s, expected", [
    (None, 900, {"collective_timeout_s": 1080.0}),  # the job's 300 s default would fail the job first
    (600, 900, {"collective_timeout_s": 1080.0}),
    (2000, 900, {}),  # above the watch already: kept
    (None, 60, {"collective_timeout_s": 240.0}),
    (600, 0, {}),  # no watch: the run config's own
])
def test_the_collective_timeout_is_set_above_the_watch(given, timeout_s, expected):
    op = make_operator(stall_timeout_s=timeout_s)
    run_config = {} if given is None else {"collective_timeout_s": given}
    assert op._collective_timeout(run_config) == expected


def test_the_nightly_dag_offers_the_stall_settings_per_run():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[3] / "dags" / "nightly_training.py"))
    assert bag.import_errors == {}
    dag = bag.dags["nightly_training"]
    recovery = load_pipeline_config().recovery
    assert {key: dag.params[key] for key in TEMPLATED} == {key: getattr(recovery, key) for key in TEMPLATED}
    train = dag.get_task("training.train")
    assert {key: getattr(train, key) for key in TEMPLATED} == TEMPLATED
    assert list(dag.params)[-2:] == ["retrain", "dry_run"]  # the trigger form's last rows stay where they were
