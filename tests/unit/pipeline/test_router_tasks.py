"""The workload router's task bodies: which branch runs for each side, what a dry run says, and a refused spec
failing at once (before any storage or cluster is looked at)."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException
from hybridflow.config import load_pipeline_config
from hybridflow.pipeline.router_tasks import BRANCHES, choose_side, route_workload
from hybridflow.pipeline.routing import routing_rules


@pytest.mark.parametrize(("target", "branch"), [
    ("spark", "run_on_cpu_spark"),
    ("slurm_gpu", "run_on_gpu_slurm"),
    ("slurm_cpu", "run_on_cpu_slurm"),
    ("triton", "serve_on_triton"),
])
def test_router_chooses_the_branch_of_the_routed_side(target, branch, capsys):
    assert choose_side({"target": target, "reason": "why"}, None, dry_run=False) == branch
    assert capsys.readouterr().out == ""


def test_router_dry_run_chooses_nothing_and_says_what_it_would_run(capsys):
    deploy = {"summary": "deploy the model of record 3"}
    assert choose_side({"target": "triton", "reason": "realtime stays on CPU"}, deploy, dry_run=True) is None
    assert capsys.readouterr().out == ("dry run: realtime stays on CPU; would run serve_on_triton: deploy the model "
                                       "of record 3; runs nothing\n")


def test_router_branches_cover_every_side_the_rules_route_to():
    rules = routing_rules()
    assert set(rules.slurm) | {"spark", "triton"} == set(BRANCHES)


@pytest.mark.parametrize(("params", "fragment"), [
    ({"workload_type": "mining", "config": {}, "profile": {}}, "mining"),
    ({"workload_type": "feature_engineering", "config": {"rm -rf": "1"}, "profile": {}}, "rm -rf"),
    ({"workload_type": "batch_inference", "config": {}, "profile": {"gpu_speedup": "fast"}}, "gpu_speedup"),
])
def test_router_refused_spec_fails_at_once_naming_the_value_and_the_runbook(params, fragment):
    config = load_pipeline_config()
    with pytest.raises(AirflowFailException, match="workload refused") as refused:
        route_workload(config, routing_rules(), params, "manual__x")
    assert fragment in str(refused.value) and "include/runbooks/workload-router.md" in str(refused.value)
