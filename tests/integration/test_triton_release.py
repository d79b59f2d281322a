"""Progressive delivery through the guard, against the real local tritonserver: the per-request split, shadow
copies, the figures and Prometheus metrics the guard keeps, its release API under hostile input, and (through
Airflow's task lifecycle) deploys that go through shadow and canary while a client keeps asking: a candidate with
shifted scores and a slow one are rolled back, a good one is promoted, and no client request fails."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers.triton_models import (
    N_FEATURES,
    TRITON_HTTP,
    deploy_dag,
    infer,
    make_export,
    publish_and_serve,
    publish_slow_version,
    ready_versions,
    remove_model,
    tiny_model,
)
from hybridflow.hooks.model_repository import LocalModelRepository
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.triton import Repository, VersionStatus
from prometheus_client.parser import text_string_to_metric_families

GUARD_ADMIN = "http://127.0.0.1:8003"
REPO = Path(__file__).resolve().parents[2]


def admin(method: str, path: str, body: bytes | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(f"{GUARD_ADMIN}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def scraped(name: str, **labels: str) -> float:
    """One sample of the guard's /metrics, 0 when absent."""
    with urllib.request.urlopen(f"{GUARD_ADMIN}/metrics", timeout=10) as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def two_versions(stack, tmp_path_factory):
    """A model with versions 1 and 2 both loaded, and a hook on the stack's Triton connection."""
    repository = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/model-repository"
    model = f"t_release_{uuid.uuid4().hex[:8]}"
    exports = tmp_path_factory.mktemp("exports")
    publish_and_serve(repository, model, {1: make_export(exports / "v1", 1), 2: make_export(exports / "v2", 2)})
    hook = TritonHook("triton_default")
    yield model, hook
    hook.close()
    remove_model(repository, model)


def test_a_canary_share_holds_over_2000_requests_and_versioned_requests_keep_their_version(two_versions):
    model, hook = two_versions
    generation = hook.set_release(model, 1, 2, mode="canary", share=10)["generation"]
    rows = np.random.default_rng(3).normal(size=(2000, N_FEATURES)).astype(np.float32)
    with ThreadPoolExecutor(8) as pool:
        answered = [version for version, _ in pool.map(lambda row: infer(model, row[None, :]), rows)]
        pinned = list(pool.map(lambda row: infer(model, row[None, :], version=1)[0], rows[:100]))
    share = answered.count("2") / len(answered)
    assert answered.count("1") + answered.count("2") == 2000
    assert 0.07 <= share <= 0.13, f"the candidate answered {share:.1%} of unversioned requests at a 10% canary"
    assert pinned == ["1"] * 100  # a request naming a version gets it, whatever the release

    figures = hook.release_figures(model)
    assert figures["generation"] == generation and figures["release"]["share"] == 10
    assert figures["candidate"]["requests"] == answered.count("2")
    assert figures["stable"]["requests"] == answered.count("1")  # the pinned ones are not the step's traffic
    assert len(figures["candidate"]["scores"]) == answered.count("2") and figures["candidate"]["errors"] == 0
    # Prometheus sees every answer, by the version that gave it, and the split now.
    assert scraped("tritonguard_requests_total", model=model, version="2", protocol="http") == answered.count("2")
    assert scraped("tritonguard_requests_total", model=model, version="1", protocol="http") \
        == answered.count("1") + 100
    assert scraped("tritonguard_request_duration_seconds_count", model=model, version="2", protocol="http") \
        == answered.count("2")
    assert scraped("tritonguard_release_share_percent", model=model, version="2", role="candidate") == 10


def test_shadow_answers_with_the_stable_version_and_compares_the_candidate_on_the_same_requests(two_versions):
    import torch

    model, hook = two_versions
    hook.set_release(model, 1, 2, mode="shadow")
    rows = np.random.default_rng(4).normal(size=(300, N_FEATURES)).astype(np.float32)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda row: infer(model, row[None, :]), rows))
    with torch.inference_mode():
        stable_scores = tiny_model(1)(torch.from_numpy(rows)).numpy().ravel()
        candidate_scores = tiny_model(2)(torch.from_numpy(rows)).numpy().ravel()
    assert {version for version, _ in answers} == {"1"}
    np.testing.assert_allclose([scores[0] for _, scores in answers], stable_scores, atol=1e-6)

    deadline = time.monotonic() + 15
    while (figures := hook.release_figures(model))["candidate"]["requests"] < 300 and time.monotonic() < deadline:
        time.sleep(0.1)  # the copies are sent after the answers: wait for the last ones
    assert figures["stable"]["requests"] == figures["candidate"]["requests"] == 300
    np.testing.assert_allclose(sorted(figures["candidate"]["scores"]), sorted(candidate_scores), atol=1e-6)
    assert scraped("tritonguard_requests_total", model=model, version="2", protocol="shadow") >= 300


@pytest.mark.parametrize(("method", "path", "body", "status", "says"), [
    ("PUT", "/v1/releases/{model}", b"{not json", 400, "release of"),
    ("PUT", "/v1/releases/{model}", b"[1, 2]", 400, "must be a JSON object"),
    ("PUT", "/v1/releases/{model}", b'{"stable": "1"}', 400, "stable: '1'; give a version number"),
    ("PUT", "/v1/releases/{model}", b'{"stable": 1e400}', 400, "give a version number"),
    ("PUT", "/v1/releases/{model}", b'{"stable": 1, "candidate": 2, "mode": "canary", "share": 1000}', 400,
     "a whole percentage"),
    ("PUT", "/v1/releases/{model}", b'{"stable": 1, "mode": "canary", "share": 10}', 400, "needs a candidate"),
    ("PUT", "/v1/releases/{model}", b'{"stable": 1, "extra": "x"}', 400, "unknown field(s) ['extra']"),
    ("PUT", "/v1/releases/{model}", b'{"stable": 1, "x": "' + b"a" * 70_000 + b'"}', 413, ""),
    ("PUT", "/v1/releases/..%2F..%2Fetc", b'{"stable": 1}', 400, "model name"),
    ("PUT", "/v1/releases/" + "m" * 200, b'{"stable": 1}', 400, "use 1-128 letters"),
    ("POST", "/v1/releases/{model}", b'{"stable": 1}', 405, "use GET, PUT or DELETE"),
    ("DELETE", "/v1/releases/never_released_model", None, 404, "no release of 'never_released_model'"),
    ("GET", "/v1/releases/never_released_model/figures", None, 404, "no release"),
    ("GET", "/v1/releases/{model}/../../metrics", None, 404, "Not Found"),
])
def test_the_release_api_refuses_bad_requests_and_changes_nothing(two_versions, method, path, body, status, says):
    model, hook = two_versions
    before = hook.set_release(model, 1)
    code, answer = admin(method, path.format(model=model), body)
    assert code == status, answer
    assert says in (answer.get("error", "") if isinstance(answer, dict) else answer)
    assert hook.release(model) == before  # the release and its generation did not move
    with urllib.request.urlopen(f"http://{TRITON_HTTP}/v2/health/ready", timeout=5) as ready:
        assert ready.status == 200


# --- Progressive deploys through Airflow, a client asking all along -------------------------------------------

# Small windows for a test; the judge's thresholds are wide enough for 100-request samples on a loaded machine
# (the chance PSI of two samples of the same scores is about 9 * (1/n1 + 1/n2) over deciles) and far from what
# a shifted (mean +0.2, PSI > 1) or slow (150 ms per batch) candidate shows.
RELEASE = {"strategy": "progressive", "shadow_s": 2, "canary_steps": [25, 100], "step_min_s": 2,
           "step_timeout_s": 90, "no_traffic": "fail", "min_requests": 100, "max_error_rate": 0.01,
           "max_p99_ms": 140, "max_mean_shift": 0.08, "max_psi": 0.5}


def test_progressive_deploys_roll_back_a_shifted_and_a_slow_candidate_and_promote_a_good_one_with_no_failed_request(
    run_dag, stack, repository, tmp_path, client_loop
):
    model = f"t_progressive_{uuid.uuid4().hex[:8]}"
    hook = TritonHook("triton_default")
    try:
        publish_and_serve(repository, model, {1: make_export(tmp_path / "v1", 1)})
        hook.set_release(model, 1)
        loop = client_loop(model)

        def deploy(label: str, export: Path, **options) -> dict:
            """A deploy as the pipeline runs it (retried where the gate before any traffic is held for the
            machine's load: CI 2026-12-07 ended the shifted one there, before its shadow step, at retries=0)."""
            dag_id = f"t_progressive_{label}_{uuid.uuid4().hex[:6]}"
            started = time.time()
            result = run_dag(deploy_dag(dag_id, export, model, repository, release=RELEASE, **options), dag_id)
            loop.windows[label] = (started, time.time())
            return result

        shifted = deploy("shifted", make_export(tmp_path / "shifted", 1, kind="shifted"), retries=2)
        assert shifted["state"] == "failed"
        report = shifted["tasks"]["deploy"]["xcom"]["deploy_report"]
        assert report["version"] == 2 and report["promoted"] is False
        assert report["release"], f"ended before its release: {report['reason']}\n{shifted['log'][-4000:]}"
        steps = report["release"]["steps"]
        assert [(s["mode"], s["outcome"]) for s in steps] == [("shadow", "fail")]
        assert "mean score shift" in report["reason"] and "PSI" in report["reason"]
        assert steps[0]["figures"]["mean_shift"] > RELEASE["max_mean_shift"]
        assert steps[0]["figures"]["psi"] > RELEASE["max_psi"]
        assert "shadow failed" in shifted["log"] and "version 1 keeps serving" in shifted["log"]
        assert ready_versions(model) == [1] and hook.release(model)["release"]["mode"] == "stable"

        slow_export = make_export(tmp_path / "slow", 1, kind="close")
        assert publish_slow_version(repository, model, slow_export, sleep_ms=150) == 3
        # The gate's SLO wide open: its like-with-like check stops it, the same load on version 1 beside it at the
        # same time, before any real traffic (the release steps' own latency checks: tests/unit/utils/test_release.py
        # and `make bench BENCH=release_judge`).
        slow = deploy("slow", slow_export, slo_p99_ms=5000, gate_requests=16, gate_warmup_requests=0)
        assert slow["state"] == "failed"
        report = slow["tasks"]["deploy"]["xcom"]["deploy_report"]
        assert report["version"] == 3 and report["promoted"] is False and report["release"] is None
        assert report["reason"].startswith("latency gate failed: p50 ratio >= "), report["reason"]
        assert report["latency"]["baseline"]["version"] == 1
        assert "fail: p50 ratio >= " in report["latency"]["decision"], report["latency"]
        assert ready_versions(model) == [1]

        good = deploy("good", make_export(tmp_path / "good", 1, kind="close", variant=1), retries=2)
        assert good["state"] == "success", good["log"][-4000:]
        report = good["tasks"]["deploy"]["xcom"]["return_value"]
        assert report["version"] == 4 and report["promoted"] is True
        steps = report["release"]["steps"]
        assert [(s["mode"], s["share"], s["outcome"]) for s in steps] == [("shadow", 0, "pass"),
                                                                          ("canary", 25, "pass")]
        assert all(s["figures"]["requests"] >= RELEASE["min_requests"] for s in steps)
        assert ready_versions(model) == [4]
        assert hook.release(model)["release"] == {"stable": 4, "candidate": None, "mode": "stable", "share": 0}
    finally:
        events = loop.stop() if "loop" in locals() else []
        hook.close()
        remove_model(repository, model)

    failed = [e for e in events if e[3]]
    assert not failed, f"{len(failed)} of {len(events)} client requests failed: {failed[:5]}"
    start, end = loop.windows["shifted"]
    assert {e[2] for e in events if start <= e[0] <= end} == {"1"}  # a shadow candidate never answers
    start, end = loop.windows["good"]
    during_good = [e[2] for e in events if start <= e[0] <= end]
    assert "4" in during_good and "1" in during_good  # the canary split, then the promotion
    assert len(events) > 500


def test_a_step_where_both_versions_break_the_slo_is_held_not_rolled_back(run_dag, stack, repository, tmp_path,
                                                                           client_loop):
    """The machine, not the candidate: the serving version and the candidate both sleep 60 ms a request (over the
    step's 50 ms SLO, neither slower than the other). The canary step ends held: the task fails naming the
    machine, on-call gets a ``release_held`` alert with the step's figures, and the candidate is not marked rolled
    back (a retry may release it once the machine recovers)."""
    from dataclasses import replace

    from hybridflow.notifiers.oncall import default_alerts_file

    model = f"t_held_{uuid.uuid4().hex[:8]}"
    repo = LocalModelRepository(Repository.parse(repository))
    hook = TritonHook("triton_default")
    try:
        stable = publish_slow_version(repository, model, make_export(tmp_path / "v1", 1), sleep_ms=60)
        repo.write_record(model, replace(repo.records(model)[stable], status=VersionStatus.PROMOTED))
        candidate_export = make_export(tmp_path / "v2", 1, kind="close", variant=1)
        assert publish_slow_version(repository, model, candidate_export, sleep_ms=60) == 2
        publish_and_serve(repository, model, {}, serve=(1,))
        hook.set_release(model, 1)
        loop = client_loop(model)
        dag_id = f"t_held_{uuid.uuid4().hex[:6]}"
        release = {**RELEASE, "shadow_s": 0, "canary_steps": [50, 100], "min_requests": 30, "max_p99_ms": 50,
                   "step_timeout_s": 30}
        # the gate's own SLO wide: the step is under test
        result = run_dag(deploy_dag(dag_id, candidate_export, model, repository, release=release, slo_p99_ms=5000,
                                    gate_requests=60, gate_warmup_requests=0),
                         dag_id)
        loop, events = None, loop.stop()
        assert not [e for e in events if e[3]], "a client request failed"
        assert result["state"] == "failed"
        report = result["tasks"]["deploy"]["xcom"]["deploy_report"]
        [step] = report["release"]["steps"]
        assert (step["share"], step["outcome"]) == (50, "held"), step
        assert report["reason"].startswith("canary 50% held: p99 >= ") and "the machine is the problem" in \
            report["reason"], report["reason"]
        assert "is held, not rolled back" in result["log"]
        assert any(line.startswith("hold: p99 >= ") for line in step["checks"]), step["checks"]
        alerts = [json.loads(line) for line in default_alerts_file().read_text().splitlines()]
        [alert] = [a for a in alerts if a["dag_id"] == dag_id and a["kind"] == "release_held"]
        assert "the machine is the problem" in alert["error"] and "hold: p99 >= " in alert["log_tail"], alert
        assert repo.records(model)[2].status is not VersionStatus.ROLLED_BACK
    finally:
        if locals().get("loop") is not None:
            loop.stop()
        hook.close()
        remove_model(repository, model)


def test_oncall_rollback_ends_a_canary_at_once_and_the_step_judging_it_stops(run_dag, stack, repository, tmp_path):
    """Mid-canary, the on-call DAG sends every unversioned request back to the stable version and unloads the
    candidate; the trigger judging the step reports the release changed under it (the deploy then stops)."""
    from hybridflow.triggers.triton import TritonReleaseStepTrigger
    from hybridflow.utils.release import StepThresholds

    model = f"t_oncall_{uuid.uuid4().hex[:8]}"
    hook = TritonHook("triton_default")
    try:
        publish_and_serve(repository, model, {1: make_export(tmp_path / "v1", 1), 2: make_export(tmp_path / "v2", 2)})
        generation = hook.set_release(model, 1, 2, mode="canary", share=50)["generation"]
        step = TritonReleaseStepTrigger("triton_default", model, generation, vars(StepThresholds(min_requests=10**6)),
                                        min_window_s=0, timeout_s=600, poll_interval_s=0.5)
        with ThreadPoolExecutor(1) as pool:
            judged = pool.submit(asyncio.run, step.wait())
            rollback = run_dag((REPO / "dags" / "oncall_rollback_model.py").read_text(), "oncall_rollback_model",
                               conf={"model_name": model})
            event = judged.result(timeout=60)
        assert rollback["state"] == "success", rollback["log"][-4000:]
        assert rollback["tasks"]["plan"]["xcom"]["return_value"] == {"model": model, "version": 1,
                                                                      "from_version": 2}
        assert hook.release(model)["release"] == {"stable": 1, "candidate": None, "mode": "stable", "share": 0}
        assert ready_versions(model) == [1]
        assert LocalModelRepository(Repository.parse(repository)).records(model)[2].status \
            is VersionStatus.ROLLED_BACK
        assert {infer(model, np.ones((1, N_FEATURES), np.float32))[0] for _ in range(20)} == {"1"}
        assert event["status"] == "superseded" and f"generation {generation} ->" in event["message"]
    finally:
        hook.close()
        remove_model(repository, model)
