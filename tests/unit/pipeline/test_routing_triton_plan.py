"""The realtime route's deployment plan: what serve_on_triton deploys and the sentence a dry run prints."""

from __future__ import annotations

import pytest
from hybridflow.config import ServingConfig
from hybridflow.pipeline.routing import RouteDecision, triton_deploy_plan

MODEL = {"version": "v7", "export_dir": "/storage/models/propensity/v7", "model_path": "/x/model.pt", "number": 7}


def decision(side: str) -> RouteDecision:
    return RouteDecision("realtime_inference", side, "triton", "default", "why")


def serving(backend: str) -> ServingConfig:
    return ServingConfig(model_name="propensity", repository="/storage/model-repository", backend=backend,
                         slo_p99_ms=50.0, gate_requests=400, gate_concurrency=4)


@pytest.mark.parametrize(("side", "backend", "server_side", "note"), [
    ("cpu", "python", "cpu", None),
    ("gpu", "pytorch_libtorch", "gpu", None),
    ("gpu", "python", "cpu", "routed to the gpu side, but this estate's Triton serves on cpu (serving.backend: "
                             "python); set serving.backend to pytorch_libtorch for gpu servers"),
    ("cpu", "pytorch_libtorch", "gpu", "routed to the cpu side, but this estate's Triton serves on gpu "
                                       "(serving.backend: pytorch_libtorch); set serving.backend to python for "
                                       "cpu servers"),
])
def test_plan_deploys_the_model_of_record_and_says_where_it_serves(side, backend, server_side, note):
    plan = triton_deploy_plan(decision(side), MODEL, serving(backend))
    assert plan["export_dir"] == MODEL["export_dir"] and plan["model_version"] == "v7"
    assert (plan["backend"], plan["server_side"], plan["model_name"]) == (backend, server_side, "propensity")
    assert plan["summary"].startswith(
        "deploy the model of record v7 (/storage/models/propensity/v7) to Triton model 'propensity' in "
        f"/storage/model-repository (backend {backend}: {server_side} instances)")
    for step in ("load it beside the serving version", "smoke test",
                 "latency gate p99 <= 50 ms over 400 requests, 4 in flight", "promote it or roll back"):
        assert step in plan["summary"]
    if note is None:
        assert "Note:" not in plan["summary"]
    else:
        assert plan["summary"].endswith(note)
