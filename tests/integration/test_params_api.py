"""The nightly DAG's params guard the REST trigger too: a bad value is refused (HTTP 400, naming the param)
and no run is created. Each request also carries dry_run=true, so a regression that accepted one would start
a run that plans and does nothing (and the test deletes it)."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from airflow_api import local_api  # noqa: E402

DAG_ID = "nightly_training"


def call(api, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(api.base_url + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {api.token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"detail": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def api(stack):
    deadline = time.monotonic() + 180  # the api-server restarts when `make up` finds its environment changed
    while True:
        try:
            return local_api()
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


@pytest.mark.parametrize(("conf", "param", "why"), [
    ({"gpus": "8; rm -rf /"}, "gpus", "is not of type 'integer'"),
    ({"model_preset": "huge"}, "model_preset", "is not one of"),
    ({"gpus": 99}, "gpus", "greater than the maximum of 8"),
    ({"epochs": 0}, "epochs", "less than the minimum of 1"),
    ({"nodes": 0}, "nodes", "less than the minimum of 1"),
    ({"nodes": 65}, "nodes", "greater than the maximum of 64"),
    ({"nodes": "2 --wrap=id"}, "nodes", "is not of type 'integer'"),
    ({"nodes": None}, "nodes", "is not of type 'integer'"),
], ids=["gpus-shell-injection", "model_preset-not-in-enum", "gpus-above-maximum", "epochs-below-minimum",
        "nodes-zero", "nodes-above-maximum", "nodes-option-injection", "nodes-null"])
def test_trigger_with_an_invalid_param_is_refused(api, conf, param, why):
    run_id = f"params_api_test__{uuid.uuid4().hex[:12]}"
    sent = {**conf, "dry_run": True}
    status, body = call(api, "POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                        {"dag_run_id": run_id, "logical_date": None, "conf": sent})
    try:
        assert status == 400, f"HTTP {status}: {body}"
        detail = str(body.get("detail"))
        assert f"Invalid input for param {param}" in detail and why in detail, detail
        assert call(api, "GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")[0] == 404, "the refused run exists"
        recent = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns?limit=50&order_by=-run_after")["dag_runs"]
        assert not [r["dag_run_id"] for r in recent if r.get("conf") == sent], "a run with that conf exists"
    finally:
        if status < 300:
            call(api, "PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", {"state": "failed"})
            call(api, "DELETE", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")
