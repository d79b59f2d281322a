"""Training generations, by tables: generation 0 keeps today's job name and run directory (a clear reattaches,
never twice); generation N names its own job and a fresh sibling run directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridflow.exceptions import InvalidJobSpecError
from hybridflow.layout import TrainingRunDir
from hybridflow.utils.slurm import JOB_NAME_MAX_LENGTH, deterministic_job_name
from hybridflow.utils.slurm_jobs import MAX_GENERATION, generation, generation_task_key

RUN_ID = "scheduled__2026-01-02T00:00:00+00:00"
RUN_DIR = "/data/runs/nightly_training/ds=2026-01-02/scheduled__2026-01-02T00_00_00_00_00"


@pytest.mark.parametrize("value, expected", [
    (0, 0), (1, 1), (MAX_GENERATION, MAX_GENERATION), ("0", 0), ("7", 7), (" 3 ", 3), ("1000", 1000),
], ids=["int-0", "int-1", "max", "text-0", "text-7", "text-spaces", "text-max"])
def test_generation_accepts_whole_numbers_in_range(value, expected):
    assert generation(value) == expected


@pytest.mark.parametrize("value", [
    -1, MAX_GENERATION + 1, "1001", "-1", "", "x", "1.5", "1e2", 1.0, True, None, "\u0663", "99999999999999999999",
], ids=["negative", "over-max", "text-over-max", "text-negative", "empty", "word", "decimal", "exponent", "float",
        "bool", "none", "arabic-digit", "huge"])
def test_generation_refuses_anything_else_naming_the_param(value):
    with pytest.raises(InvalidJobSpecError, match=r"retrain=.* is invalid: use a whole number from 0 to 1000"):
        generation(value)


@pytest.mark.parametrize("task_id, gen, key", [
    ("training.train", 0, "training.train"),
    ("training.train", 1, "training.train@retrain-1"),
    ("train.3", 12, "train.3@retrain-12"),
], ids=["gen0-unchanged", "gen1", "mapped-gen12"])
def test_generation_task_key(task_id, gen, key):
    assert generation_task_key(task_id, gen) == key


@pytest.mark.parametrize("run_dir, gen, expected", [
    (RUN_DIR, 0, RUN_DIR),
    (RUN_DIR, 1, f"{RUN_DIR}.retrain-1"),
    (f"{RUN_DIR}/", 2, f"{RUN_DIR}.retrain-2"),
    (f"{RUN_DIR}.retrain-1", 1, f"{RUN_DIR}.retrain-1"),
    (f"{RUN_DIR}.retrain-11", 1, f"{RUN_DIR}.retrain-11.retrain-1"),
    (f"{RUN_DIR}.retrain-1", 2, f"{RUN_DIR}.retrain-1.retrain-2"),
], ids=["gen0-unchanged", "gen1-sibling", "trailing-slash", "already-gen1-idempotent", "gen11-is-not-gen1",
        "other-generation-suffixed"])
def test_generation_run_dir(run_dir, gen, expected):
    assert TrainingRunDir(run_dir).for_generation(gen) == TrainingRunDir(expected)


def test_generation_run_dir_is_never_inside_the_earlier_generation():
    """A subdirectory would sit in the earlier run's tree; a sibling leaves that tree exactly as it was."""
    for gen in (1, 2, MAX_GENERATION):
        assert not TrainingRunDir(RUN_DIR).for_generation(gen).root.startswith(f"{RUN_DIR}/")


def test_generation_job_names_gen0_unchanged_each_generation_its_own_stable_valid_name():
    names = [deterministic_job_name("nightly_training", generation_task_key("training.train", g), RUN_ID)
             for g in (0, 1, 2, MAX_GENERATION)]
    assert names[0] == deterministic_job_name("nightly_training", "training.train", RUN_ID)  # jobs before stay found
    assert len(set(names)) == len(names)
    assert names == [deterministic_job_name("nightly_training", generation_task_key("training.train", g), RUN_ID)
                     for g in (0, 1, 2, MAX_GENERATION)]  # the same on every try: a crash reattaches
    assert all(len(n) <= JOB_NAME_MAX_LENGTH and "@" not in n for n in names)
    assert "training.train_retrain-1-scheduled__2026" in names[1]  # readable in squeue


def test_generation_no_real_task_id_shares_a_generation_key():
    """A group 'train' holding a task 'retrain-1' must not take generation 1's job."""
    assert deterministic_job_name("d", "train.retrain-1", "r") != deterministic_job_name(
        "d", generation_task_key("train", 1), "r")


# --- the operator: paths and job name follow the generation -----------------------------------------------------

def make_operator(retrain, **kwargs):
    from hybridflow.operators.training import DeepSpeedTrainingOperator

    return DeepSpeedTrainingOperator(task_id="train", run_config={}, run_dir=RUN_DIR, python="/py",
                                     jobs_dir="/jobs", partition="gpu-training", retrain=retrain, **kwargs)


def context_for(op, params=None):
    ti = SimpleNamespace(dag_id="nightly_training", task_id=op.task_id, map_index=-1, run_id=RUN_ID)
    return {"ti": ti, "params": params or {}}


@pytest.mark.parametrize("retrain, run_dir", [
    (0, RUN_DIR), ("{{ params.retrain }}", f"{RUN_DIR}.retrain-3"),
], ids=["gen0", "templated-gen3"])
def test_generation_operator_moves_every_derived_path_once_rendered(retrain, run_dir):
    op = make_operator(retrain)
    op.render_template_fields(context_for(op, {"retrain": 3}))
    assert op.run_dir == run_dir
    assert op.command == ["/py", "/jobs/train.py", "--config", f"{run_dir}/config.json"]
    assert (op.log_dir, op.progress_path) == (f"{run_dir}/logs", f"{run_dir}/progress.json")
    op._apply_generation()  # execute() applies it again: nothing moves twice
    assert op.run_dir == run_dir and op.command[-1] == f"{run_dir}/config.json"


def test_generation_operator_keeps_paths_given_explicitly():
    op = make_operator(2, log_dir="/logs/here", progress_path="/p.json")
    op.render_template_fields(context_for(op))
    assert op.run_dir == f"{RUN_DIR}.retrain-2"
    assert (op.log_dir, op.progress_path) == ("/logs/here", "/p.json")


@pytest.mark.parametrize("retrain, task_key", [(0, "train"), (1, "train@retrain-1"), ("5", "train@retrain-5")],
                         ids=["gen0", "gen1", "text-gen5"])
def test_generation_operator_job_name(retrain, task_key):
    op = make_operator(retrain)
    assert op.job_name(context_for(op)) == deterministic_job_name("nightly_training", task_key, RUN_ID)


@pytest.mark.parametrize("retrain, task_key", [(0, "evaluate"), ("4", "evaluate@retrain-4")], ids=["gen0", "gen4"])
def test_generation_slurm_operator_job_name(retrain, task_key):
    """The evaluation job of generation N is its own job too: it must not reattach to generation 0's result."""
    from hybridflow.operators.training import GenerationSlurmSubmitOperator

    op = GenerationSlurmSubmitOperator(task_id="evaluate", command=["true"], partition="cpu", log_dir="/l",
                                       retrain=retrain)
    assert op.job_name(context_for(op)) == deterministic_job_name("nightly_training", task_key, RUN_ID)


def test_generation_operator_refuses_a_bad_generation_before_anything_runs():
    op = make_operator("{{ params.retrain }}")
    with pytest.raises(InvalidJobSpecError, match="retrain='-1' is invalid"):
        op.render_template_fields(context_for(op, {"retrain": -1}))


# --- the nightly DAG: prepare puts the generation in run_dir, the train task in the job name ---------------------

@pytest.mark.parametrize("params, run_dir_end", [
    ({}, "/ds=2026-01-02/scheduled__2026-01-02T00_00_00_00_00"),
    ({"retrain": 0}, "/ds=2026-01-02/scheduled__2026-01-02T00_00_00_00_00"),
    ({"retrain": 2}, "/ds=2026-01-02/scheduled__2026-01-02T00_00_00_00_00.retrain-2"),
], ids=["param-absent-old-run", "gen0", "gen2"])
def test_generation_nightly_prepare_training_run_dir(tmp_path, monkeypatch, params, run_dir_end,
                                                    empty_model_registry):
    from hybridflow.config import load_pipeline_config
    from hybridflow.pipeline.nightly_tasks import prepare_training

    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", str(tmp_path))
    (tmp_path / "features" / "ds=2026-01-02").mkdir(parents=True)
    (tmp_path / "features" / "ds=2026-01-02" / "_MANIFEST.json").write_text('{"ds": "2026-01-02"}')
    (tmp_path / "features" / "ds=2026-01-02" / "_SUCCESS").touch()
    base = {"model_preset": "tiny", "train_window_days": 1, "epochs": 1, "max_steps": 10}
    prepared = prepare_training(load_pipeline_config(), "2026-01-02", RUN_ID, {**base, **params})
    assert prepared["run_dir"] == f"{tmp_path}/runs/nightly_training{run_dir_end}"
    assert prepared["run_config"]["labels"]["retrain"] == params.get("retrain", 0)


def test_generation_nightly_dag_wires_the_param_into_the_train_task():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[3] / "dags" / "nightly_training.py"))
    assert bag.import_errors == {}
    dag = bag.dags["nightly_training"]
    schema = dag.params.get_param("retrain").schema
    assert (dag.params["retrain"], schema["type"], schema["minimum"], schema["maximum"]) == (0, "integer", 0, 1000)
    for task_id in ("training.train", "evaluation.evaluate"):  # both Slurm jobs of a generation
        assert dag.get_task(task_id).retrain == "{{ params.retrain }}"
