"""The approval wiring, parsed and rendered as the worker renders it: in the nightly DAG (deploy=ask) and in
release_model, the deploy holds a release -> needs_approval -> approve_release (Airflow's human-in-the-loop:
Promote or Roll back, Roll back on timeout after serving.release.approval_timeout_s) -> finish_release, and the
run's report and registry record wait for the decision. The ask itself runs for real in
tests/integration/test_release_approval.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridflow.config import load_pipeline_config
from hybridflow.operators.triton import held_release

REPO = Path(__file__).resolve().parents[2]


def parsed(name: str):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / f"{name}.py"))
    assert bag.import_errors == {}
    return bag.dags[name]


@pytest.mark.parametrize("dag_id, prefix", [("nightly_training", "deploy."), ("release_model", "")])
def test_a_held_release_is_asked_then_decided_and_the_decision_comes_before_the_report(dag_id, prefix):
    dag = parsed(dag_id)
    release = load_pipeline_config().serving.release
    deploy, needs = dag.get_task(f"{prefix}deploy_model"), dag.get_task(f"{prefix}needs_approval")
    approve, finish = dag.get_task(f"{prefix}approve_release"), dag.get_task(f"{prefix}finish_release")
    assert needs.upstream_task_ids == {deploy.task_id}
    assert approve.upstream_task_ids == {needs.task_id} and finish.upstream_task_ids == {approve.task_id}
    # a deploy that promotes on its own skips only the asking, not what follows the deploy
    assert needs.ignore_downstream_trigger_rules is False
    assert approve.options == ["Promote", "Roll back"] and approve.defaults == ["Roll back"]
    assert approve.response_timeout == timedelta(seconds=release.approval_timeout_s)
    assert (finish.deploy_task_id, finish.approval_task_id) == (deploy.task_id, approve.task_id)
    assert finish.model_name == deploy.model_name and finish.repository == deploy.repository
    if dag_id == "nightly_training":
        assert finish.task_id in dag.get_task("report.write_report").upstream_task_ids
        assert finish.task_id in dag.get_task("report.record_in_registry").upstream_task_ids
        assert dag.get_task("report.write_report").sources["release"] == finish.task_id


@pytest.mark.parametrize("deploy_mode, approval", [("ask", "ask"), ("auto", "auto"), ("always", "auto")])
def test_the_nightly_deploy_asks_only_with_deploy_ask(deploy_mode, approval):
    dag = parsed("nightly_training")
    task = dag.get_task("deploy.deploy_model")
    xcoms = {"preflight.plan": {"deploy_mode": deploy_mode}, "scoring.model_of_record": {"version_uri": ""},
             "deploy.plan_deploy": "/exports/x"}
    ti = SimpleNamespace(xcom_pull=lambda task_ids, key="return_value": xcoms[task_ids])
    task.render_template_fields({"ti": ti, "params": {}, "ds": "2026-01-02", "run_id": "r"})
    assert task.approval == approval


def test_release_model_renders_the_trigger_form_into_the_deploy():
    dag = parsed("release_model")
    assert dag.params["approval"] == "ask"
    task = dag.get_task("deploy_model")
    task.render_template_fields({"params": {"model_name": "fraud", "version": 7, "approval": "auto"}})
    assert (task.model_name, task.published_version(), task.approval, task.export_dir) == ("fraud", 7, "auto", "")


@pytest.mark.parametrize(
    "report, asked",
    [
        ({"model": "m", "version": 2, "previous_version": 1, "promoted": False,
          "release": {"steps": [], "awaiting_approval": True}}, True),
        ({"model": "m", "version": 2, "previous_version": 1, "promoted": True, "release": {"steps": []}}, False),
        ({"model": "m", "version": 2, "previous_version": None, "promoted": True}, False),
        (None, False),  # the deploy pushed nothing (it failed before its report)
    ],
)
def test_needs_approval_asks_only_for_a_held_release(report, asked):
    ti = SimpleNamespace(xcom_pull=lambda task_ids, key: report)
    request = held_release("deploy.deploy_model", 3600, ti=ti)
    if asked:
        assert request["subject"] == "Promote m version 2? (serving: version 1)"
    else:
        assert request is False
