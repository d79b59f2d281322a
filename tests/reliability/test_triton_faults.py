"""Issue 7, Triton side: the serving server restarted (``localstack down triton`` + ``up triton``) in the middle
of a TritonDeployOperator run on the real local stack, while a client in another process keeps asking for the
model. The failing-load half of the item is tests/integration/test_triton_deploy.py's
``test_deploy_promotes_good_versions_rolls_back_bad_ones...``.

Each test states what it injects, checks that the deploy rolled back, the previous version alone serves and no
client request was lost, and prints its figures as a ``RELIABILITY`` line.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections import Counter

import pytest
from helpers.reliability import report
from helpers.stack import localstack
from helpers.triton_models import TRITON_HTTP, deploy_dag, make_export, ready_versions, remove_model
from helpers.waiting import joined, run_in_thread, wait_until
from hybridflow.hooks.model_repository import LocalModelRepository
from hybridflow.utils.triton import Repository, VersionStatus

CLIENT_RETRY_S = 60.0  # how long the client loop asks again while the server is away (no answer within 5 s)
POLL_S = 0.05  # how often the test looks for the moment it waits for: a version is LOADING for a short while

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def restart_triton() -> dict[str, float]:
    """Stops the triton service (SIGTERM: it drains its connections, then exits) and starts it again, even when
    the stop fails. Returns ``stop_s`` (until it exited) and ``restart_s`` (until it answered ready again)."""
    figures: dict[str, float] = {}
    started = time.monotonic()
    try:
        localstack("down", "triton")
        figures["stop_s"] = time.monotonic() - started
    finally:
        localstack("up", "triton")
        figures["restart_s"] = time.monotonic() - started
    return figures


@pytest.fixture
def model_name(stack, repository):
    name = f"r_triton_{uuid.uuid4().hex[:8]}"
    yield name
    localstack("up", "triton")  # a failed test may have left it down
    remove_model(repository, name)


def version_state(model: str, version: int) -> str:
    """The version's state in the server's repository index ('' when absent or the server is away)."""
    try:
        request = urllib.request.Request(f"http://{TRITON_HTTP}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=2) as answer:
            index = json.load(answer)
    except OSError:
        return ""
    return next((m.get("state", "") for m in index if m["name"] == model and m.get("version") == str(version)), "")


def inference_count(model: str, version: int) -> int:
    try:
        with urllib.request.urlopen(f"http://{TRITON_HTTP}/v2/models/{model}/versions/{version}/stats",
                                    timeout=2) as answer:
            return sum(s.get("inference_count", 0) for s in json.load(answer)["model_stats"])
    except OSError:
        return 0


# Where the restart lands: while the server loads version 2 (the trigger's load request in flight), while the
# task gates it (a gate of 20,000 requests, so that it is still running when the server is told to stop), or
# while the server loads a version 2 that fails to load (model.pt is not TorchScript): phase -> (broken, gate).
PHASES = {"loading": (False, 200), "gating": (False, 20_000), "loading-broken": (True, 200)}


@pytest.mark.parametrize("phase", list(PHASES))
def test_triton_restart_mid_deploy_rolls_back_and_the_client_loses_no_request(
    run_dag, model_name, repository, tmp_path, client_loop, phase
):
    """Injected: version 1 serves; a client loop keeps asking for the model; version 2 is deployed and the
    triton service is restarted (stopped, which drains and exits, then started again) while version 2 loads or
    while it is gated. Expected: the deploy rolls back (ModelRolledBack, its message says the server restarted
    mid-deploy and names the runbook), version 1 is the only READY version, version 2 is marked rolled back.

    The client: a server that is restarting cannot answer while it is down (one server, nothing in front of it),
    so the client retries a request that meets a connection error for up to 60 s, on a new connection; the test
    asserts that not one request failed after those retries and reports how many needed one."""
    repo = LocalModelRepository(Repository.parse(repository))
    first_id = f"r_triton_v1_{uuid.uuid4().hex[:6]}"
    first = run_dag(deploy_dag(first_id, make_export(tmp_path / "e1", 1), model_name, repository), first_id)
    assert first["state"] == "success", first["log"][-4000:]
    assert ready_versions(model_name) == [1]

    served = inference_count(model_name, 1)
    loop = client_loop(model_name, retry_s=CLIENT_RETRY_S, network_timeout_s=5)
    wait_until("the client's first answers", lambda: inference_count(model_name, 1) > served + 20, timeout_s=30,
               every_s=POLL_S)

    dag_id = f"r_triton_v2_{uuid.uuid4().hex[:6]}"
    broken, gate_requests = PHASES[phase]
    source = deploy_dag(dag_id, make_export(tmp_path / "e2", 2, "broken" if broken else "good"), model_name,
                        repository, gate_requests)
    deploy_started = time.monotonic()
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=600)
    try:
        wait_until("version 2 in the version policy", lambda: "versions: [ 1, 2 ]" in (repo.read_config(model_name)
                                                                                        or ""), timeout_s=120,
                   every_s=POLL_S)
        if phase.startswith("loading"):
            wait_until("version 2 LOADING", lambda: version_state(model_name, 2) == "LOADING", timeout_s=60,
                       every_s=POLL_S)
        else:
            # The smoke test is 1 request of 16 rows; past a few hundred inferences the gate is running.
            wait_until("the latency gate on version 2", lambda: inference_count(model_name, 2) > 500, timeout_s=90,
                       every_s=POLL_S)
        state_at_stop = version_state(model_name, 2)
        restart = restart_triton()
        result = joined(thread, box, 400)
    finally:
        if thread.is_alive():
            thread.join(400)
    deploy_s = time.monotonic() - deploy_started
    served = inference_count(model_name, 1)
    wait_until("the client's answers after the rollback", lambda: inference_count(model_name, 1) > served + 20,
               timeout_s=CLIENT_RETRY_S, every_s=POLL_S)
    events = loop.stop()

    xcom = result["tasks"]["deploy"]["xcom"]
    deploy_report = xcom.get("deploy_report") or {}
    final_ready = ready_versions(model_name)
    found = repo.records(model_name)
    retried = [e for e in events if e[4] > 1]
    failed = [e for e in events if e[3]]
    outage_s = (max(e[0] + e[1] for e in retried) - min(e[0] for e in retried)) if retried else 0.0
    reason = deploy_report.get("reason") or ""
    # A broken version may fail to load before the server stops (then it fails as any broken version does).
    reasons = ("restarted mid-deploy", "did not load") if broken else ("restarted mid-deploy",)
    rolled_back = f"{model_name} version 2 was rolled back" in result["log"] and any(r in reason for r in reasons)
    cause = "restart" if "restarted mid-deploy" in reason else "load_failed" if "did not load" in reason else "other"
    outcome = f"rolled_back_{cause}" if rolled_back else f"{result['state']}_{cause}"
    print(f"deploy reason ({phase}): {reason}", flush=True)
    report("triton-restart", phase=phase, v2_state_at_stop=state_at_stop or "-",
           stop_s=f"{restart['stop_s']:.1f}", restart_s=f"{restart['restart_s']:.1f}",
           server_down_s=f"{outage_s:.1f}", client_requests=len(events), retried_requests=len(retried),
           max_tries=max((e[4] for e in events), default=0),
           max_request_s=f"{max((e[1] for e in events), default=0):.1f}", failed_after_retries=len(failed),
           answered_by=",".join(f"v{v}:{n}" for v, n in sorted(Counter(e[2] for e in events if e[2]).items())),
           final_ready_versions=final_ready, deploy_state=result["state"],
           deploy_outcome=outcome, deploy_s=f"{deploy_s:.0f}")

    assert result["state"] == "failed", result["log"][-4000:]
    assert rolled_back, result["log"][-4000:]
    assert (deploy_report["version"], deploy_report["previous_version"], deploy_report["promoted"]) == (2, 1, False)
    if "restarted mid-deploy" in reason:
        assert "ModelRolledBack" in result["log"]  # retried: the version may pass on the restarted server
    assert "Runbook: include/runbooks/deploy.md" in result["log"]
    assert "version 1 keeps serving" in result["log"]
    assert final_ready == [1]
    assert "versions: [ 1 ]" in repo.read_config(model_name)
    assert found[1].status is VersionStatus.PROMOTED and found[2].status is VersionStatus.ROLLED_BACK
    assert found[2].reason == reason
    assert failed == [], f"{len(failed)} requests failed after retries: {failed[:5]}"
    assert retried, "the restart never reached the client"
    after = [e for e in events if e[0] > max(e[0] for e in retried)]
    assert len(after) > 20, f"the client got {len(after)} answers after the restart"


def test_triton_down_past_the_budget_fails_clearly_and_the_server_starts_with_the_previous_version(
    run_dag, model_name, repository, tmp_path
):
    """Injected: the triton service stopped while version 2 loads and started again only after the deploy's
    budget (readiness_timeout_s 10 s) has run out. Expected: the task fails naming the restart, the budget and
    the runbook; the config already names only version 1, so the server, once started, serves version 1 alone."""
    repo = LocalModelRepository(Repository.parse(repository))
    first_id = f"r_triton_v1_{uuid.uuid4().hex[:6]}"
    first = run_dag(deploy_dag(first_id, make_export(tmp_path / "e1", 1), model_name, repository), first_id)
    assert first["state"] == "success", first["log"][-4000:]

    dag_id = f"r_triton_budget_{uuid.uuid4().hex[:6]}"
    source = deploy_dag(dag_id, make_export(tmp_path / "e2", 2), model_name, repository, readiness_timeout_s=10)
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=300)
    stopped = time.monotonic()
    try:
        wait_until("version 2 LOADING", lambda: version_state(model_name, 2) == "LOADING", timeout_s=120,
                   every_s=POLL_S)
        stopped = time.monotonic()
        localstack("down", "triton")
        result = joined(thread, box, 240)
    finally:
        down_s = time.monotonic() - stopped
        localstack("up", "triton")
    final_ready = ready_versions(model_name)
    found = repo.records(model_name)
    report("triton-down-past-budget", server_down_s=f"{down_s:.0f}", budget_s=10, deploy_state=result["state"],
           final_ready_versions=final_ready, v2_status=found[2].status.value)
    assert result["state"] == "failed", result["log"][-4000:]
    assert "the Triton server restarted mid-deploy" in result["log"]
    assert "did not answer again within 10 s; its config names only version 1" in result["log"]
    assert "Runbook: include/runbooks/deploy.md" in result["log"]
    assert "versions: [ 1 ]" in repo.read_config(model_name)
    assert final_ready == [1]
