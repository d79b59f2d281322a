"""The nightly DAG's placement wiring, rendered as the worker renders it: the plan decides CPU or GPU once; the
capacity gate, the train task and the evaluate task take partition and GPUs per node from the plan's and the
prepare task's XCom. A default (device=auto) run of the small preset trains on the cpu partition without GRES;
device=gpu keeps today's GPU job."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridflow.config import load_pipeline_config
from hybridflow.pipeline.nightly_tasks import plan, prepare_training
from hybridflow.utils.slurm import render_sbatch_script

REPO = Path(__file__).resolve().parents[2]
DS = "2026-01-02"
RUN_ID = "manual__2026-01-02T00:00:00+00:00"


@pytest.fixture
def dag():
    """The nightly DAG, parsed fresh (rendering changes its tasks' fields)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "nightly_training.py"))
    assert bag.import_errors == {}
    return bag.dags["nightly_training"]


@pytest.fixture
def features(tmp_path, monkeypatch, empty_model_registry):
    """A storage root with the run's features partition published (100k rows), as the features stage leaves it."""
    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", str(tmp_path))
    partition = tmp_path / "features" / f"ds={DS}"
    partition.mkdir(parents=True)
    (partition / "_MANIFEST.json").write_text(json.dumps({"ds": DS, "row_count": 100_000}))
    (partition / "_SUCCESS").touch()
    return tmp_path


def run_params(dag, **conf) -> dict:
    """The run's params as a trigger with ``conf`` resolves them (the DAG's defaults under the conf)."""
    return {**{name: dag.params[name] for name in dag.params}, **conf}


def render(dag, task_id: str, params: dict, xcoms: dict):
    task = dag.get_task(task_id)
    def xcom_pull(task_ids: str, key: str = "return_value"):
        assert dag.has_task(task_ids), f"{task_id} pulls the XCom of {task_ids!r}, which is no task of the DAG"
        return xcoms[task_ids]

    ti = SimpleNamespace(dag_id=dag.dag_id, task_id=task_id, map_index=-1, run_id=RUN_ID, xcom_pull=xcom_pull)
    task.render_template_fields({"ti": ti, "params": params, "ds": DS, "run_id": RUN_ID})
    return task


def planned(dag, features, **conf) -> tuple[dict, dict]:
    config = load_pipeline_config()
    params = run_params(dag, **conf)
    xcoms = {"preflight.plan": plan(config, "manual", params, DS).as_dict(),
             "training.prepare": prepare_training(config, DS, RUN_ID, params)}
    return params, xcoms


def test_nightly_default_run_of_the_small_preset_is_planned_onto_the_cpu_partition(dag, features):
    """The issue's case: device=auto (the default) and the default preset (small) take no GPU."""
    params, xcoms = planned(dag, features)
    assert (params["device"], params["model_preset"]) == ("auto", "small")
    placement = xcoms["preflight.plan"]["placement"]
    assert (placement["side"], placement["partition"], placement["gpus_per_node"]) == ("cpu", "cpu", 0)
    assert "small: CPU 80k rows/s" in placement["reason"] and placement["reason"].endswith("-> cpu partition")

    gate = render(dag, "capacity.wait_for_gpus", params, xcoms)
    assert (gate.partition, gate.gpus_per_node, gate.nodes) == ("cpu", "0", "1")

    train = render(dag, "training.train", params, xcoms)
    assert (train.partition, train.gpus_per_node, train.ranks_per_node) == ("cpu", "0", "1")
    assert train.placement_side == "cpu"
    script = render_sbatch_script(train.build_spec("hf-test"))
    assert "#SBATCH --partition=cpu" in script and "--gres" not in script
    assert "#SBATCH --ntasks-per-node=1" in script and "--gpus-per-task" not in script
    assert "export CUDA_VISIBLE_DEVICES=''" in script  # CPU ranks even on a node whose GPUs are not fenced

    evaluate = render(dag, "evaluation.evaluate", params, xcoms)
    assert (evaluate.partition, evaluate.gpus_per_node) == ("cpu", "0")  # a small pair: ~0.1 s on CPU


@pytest.mark.parametrize("conf, partition, gres", [
    ({"device": "gpu", "gpus_per_node": 2}, "gpu-training", "#SBATCH --gres=gpu:2"),
    ({"model_preset": "large"}, "gpu-training", "#SBATCH --gres=gpu:1"),  # 4016x faster on a GPU
    ({"model_preset": "tiny"}, "gpu-training", "#SBATCH --gres=gpu:1"),  # no GPU figure: keeps the GPU
    ({"device": "cpu", "model_preset": "large", "gpus_per_node": 2}, "cpu", None),
], ids=["small-gpu-asked", "large-auto", "tiny-not-measured", "large-cpu-asked"])
def test_nightly_placement_renders_into_the_gate_and_the_train_job(dag, features, conf, partition, gres):
    params, xcoms = planned(dag, features, **conf)
    gate = render(dag, "capacity.wait_for_gpus", params, xcoms)
    train = render(dag, "training.train", params, xcoms)
    ranks = str(params["gpus_per_node"])
    gpus = ranks if gres else "0"
    assert (gate.partition, gate.gpus_per_node) == (partition, gpus)
    assert (train.partition, train.gpus_per_node, train.ranks_per_node) == (partition, gpus, ranks)
    script = render_sbatch_script(train.build_spec("hf-test"))
    assert f"#SBATCH --partition={partition}" in script
    assert (gres in script) if gres else ("--gres" not in script and "CUDA_VISIBLE_DEVICES=''" in script)
    if gres:
        assert "CUDA_VISIBLE_DEVICES" not in script and "--gpus-per-task=1" in script


def test_nightly_evaluation_of_a_large_challenger_runs_on_the_gpu_partition(dag, features, monkeypatch):
    """A large challenger scored on a 1M-row window's holdout (200k rows): ~100 s on CPU, so one GPU."""
    (features / "features" / f"ds={DS}" / "_MANIFEST.json").write_text(json.dumps({"ds": DS, "row_count": 1_000_000}))
    params, xcoms = planned(dag, features, model_preset="large")
    evaluation = xcoms["training.prepare"]["evaluation_placement"]
    assert (evaluation["side"], evaluation["holdout_rows"]) == ("gpu", 200_000), evaluation["reason"]
    task = render(dag, "evaluation.evaluate", params, xcoms)
    assert (task.partition, task.gpus_per_node) == ("gpu-training", "1")
    script = render_sbatch_script(task.build_spec("hf-test"))
    assert "#SBATCH --gres=gpu:1" in script and "CUDA_VISIBLE_DEVICES" not in script


def test_nightly_plan_prints_nothing_it_cannot_back(dag, features):
    """The plan's placement carries every figure it names: rows/s, cost per 1,000 rows, where measured."""
    _, xcoms = planned(dag, features)
    placement = xcoms["preflight.plan"]["placement"]
    for side in ("cpu", "gpu"):
        assert placement[side]["rows_per_s"] > 0 and placement[side]["usd_per_1k_rows"] > 0
        assert "2026-12" in placement[side]["measured"]
    assert json.loads(json.dumps(xcoms)) == xcoms  # XCom-ready


def test_nightly_report_reads_the_placement_from_tasks_of_the_dag(dag):
    """The report's sources (the plan sits in the preflight group: ``preflight.plan``) are tasks of the DAG."""
    from hybridflow.operators.report import NIGHTLY_SOURCES

    assert NIGHTLY_SOURCES["plan"] == "preflight.plan"
    assert [task_id for task_id in NIGHTLY_SOURCES.values() if not dag.has_task(task_id)] == []


def test_nightly_run_planned_before_placement_keeps_its_gpu_job_when_a_task_is_cleared(dag, features):
    """A run planned by the DAG before placement existed has no placement in its XComs: its cleared gate, train
    and evaluate tasks render the GPU job and the cpu evaluation they had."""
    params, xcoms = planned(dag, features, gpus_per_node=2)
    xcoms["preflight.plan"].pop("placement")
    for key in ("eval_partition", "eval_gpus", "evaluation_placement"):
        xcoms["training.prepare"].pop(key)
    gate = render(dag, "capacity.wait_for_gpus", params, xcoms)
    train = render(dag, "training.train", params, xcoms)
    evaluate = render(dag, "evaluation.evaluate", params, xcoms)
    assert (gate.partition, gate.gpus_per_node) == ("gpu-training", "2")
    assert (train.partition, train.gpus_per_node, train.ranks_per_node) == ("gpu-training", "2", "2")
    assert (evaluate.partition, evaluate.gpus_per_node) == ("cpu", "0")
