"""Issue 7, Triton side: the serving server restarted (``localstack down triton`` + ``up triton``) in the middle
of a TritonDeployOperator run on the real local stack, while a client in another process keeps asking for the
model. The failing-load half of the item is tests/integration/test_triton_deploy.py's
``test_deploy_promotes_good_versions_rolls_back_bad_ones...``.

Each test states what it injects, checks that the deploy rolled back, the previous version alone serves and no
client request was lost, and prints its figures as a ``RELIABILITY`` line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hybridflow.hooks.model_repository import LocalModelRepository
from hybridflow.hooks.triton import TritonHook
from hybridflow.utils.triton import Repository, VersionStatus

REPO = Path(__file__).resolve().parents[2]
LOCALSTACK = [sys.executable, str(REPO / "scripts" / "localstack.py")]
TRITON_HTTP = "127.0.0.1:8000"
N_FEATURES = 8
CLIENT_RETRY_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.integration]

# Copied from tests/integration/test_triton_deploy.py (test modules are not imported), gate size a parameter.
DEPLOY_DAG = textwrap.dedent('''
    from datetime import datetime
    from airflow.sdk import DAG
    from hybridflow.operators.triton import TritonDeployOperator

    with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
        TritonDeployOperator(
            task_id="deploy",
            export_dir="{export_dir}",
            model_name="{model}",
            repository="{repository}",
            slo_p99_ms=50,
            concurrency=4,
            gate_requests={gate_requests},
            readiness_timeout_s={readiness_timeout_s},
            retries=0,
        )
''')

# A client that keeps asking for the model (no version: what the server serves), in its own process. A request
# that meets a connection error (refused, reset, closed, or no answer within 5 s: the server is down or
# restarting) is sent again, on a new connection, for up to the retry budget; any other error fails it at once.
# Writes, when stopped, each request's start, duration, answering version, error (empty: answered) and tries.
CLIENT_LOOP = textwrap.dedent('''
    import json, signal, sys, time
    from http.client import HTTPException
    import numpy as np
    import tritonclient.http as triton_http
    name, url, out, n_features, retry_s = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    client = triton_http.InferenceServerClient(url, network_timeout=5)
    batch = np.ones((1, n_features), np.float32)
    events = []
    while not stop:
        started, tries = time.time(), 0
        while True:
            tries += 1
            data = triton_http.InferInput("INPUT__0", list(batch.shape), "FP32")
            data.set_data_from_numpy(batch, binary_data=True)
            try:
                version, error = client.infer(name, [data]).get_response()["model_version"], ""
                break
            except (OSError, HTTPException) as exc:  # the server is away: ask again, on a new connection
                version, error = "", repr(exc)[:300]
                if time.time() - started > retry_s:
                    break
                client.close()
                time.sleep(0.2)
                client = triton_http.InferenceServerClient(url, network_timeout=5)
            except Exception as exc:
                version, error = "", repr(exc)[:300]
                break
        events.append([started, time.time() - started, version, error, tries])
        time.sleep(0.01)
    json.dump(events, open(out, "w"))
''')


def report(scenario: str, **figures) -> None:
    line = " ".join(f"{key}={value}" for key, value in figures.items())
    print(f"RELIABILITY {scenario} {line}", flush=True)


def localstack(action: str, service: str) -> None:
    done = subprocess.run([*LOCALSTACK, action, service], capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"localstack {action} {service} failed:\n{done.stdout}\n{done.stderr}")


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


def wait_until(what: str, check, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def tiny_model(seed: int) -> torch.jit.ScriptModule:
    torch.manual_seed(seed)
    return torch.jit.script(torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 1), torch.nn.Sigmoid()).eval())


def make_export(directory: Path, seed: int, broken: bool = False) -> Path:
    """An export dir as jobs/hybridtrain/export.py writes it; ``broken``: model.pt is not a TorchScript archive
    (the server fails to load it)."""
    directory.mkdir(parents=True)
    model = tiny_model(seed)
    inputs = np.random.default_rng(seed).normal(size=(16, N_FEATURES)).astype(np.float32)
    with torch.inference_mode():
        outputs = model(torch.from_numpy(inputs)).numpy()
    if broken:
        (directory / "model.pt").write_bytes(b"this is not a TorchScript archive " + str(seed).encode())
    else:
        model.save(str(directory / "model.pt"))
    signature = {"format": "torchscript", "feature_columns": [f"f{i}" for i in range(N_FEATURES)],
                 "n_features": N_FEATURES, "step": seed,
                 "inputs": [{"name": "INPUT__0", "dtype": "float32", "shape": [-1, N_FEATURES]}],
                 "outputs": [{"name": "OUTPUT__0", "dtype": "float32", "shape": [-1, 1], "meaning": "probability"}]}
    smoke = {"input_name": "INPUT__0", "output_name": "OUTPUT__0", "atol": 1e-5, "inputs": inputs.tolist(),
             "outputs": outputs.tolist()}
    (directory / "signature.json").write_text(json.dumps(signature))
    (directory / "smoke.json").write_text(json.dumps(smoke))
    return directory


@pytest.fixture
def repository(stack) -> str:
    return f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/model-repository"


@pytest.fixture
def model_name(stack, repository):
    name = f"r_triton_{uuid.uuid4().hex[:8]}"
    yield name
    localstack("up", "triton")  # a failed test may have left it down
    hook = TritonHook("triton_default")
    try:
        hook.unload_model(name)
    finally:
        hook.close()
        LocalModelRepository(Repository.parse(repository)).remove_model(name)


class ClientLoop:
    def __init__(self, name: str, out: Path):
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT_LOOP, name, TRITON_HTTP, str(out),
                                      str(N_FEATURES), str(CLIENT_RETRY_S)])

    def stop(self) -> list[list]:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=CLIENT_RETRY_S + 30)
        return json.loads(self.out.read_text())


@pytest.fixture
def client_loop(stack, tmp_path):
    loops: list[ClientLoop] = []

    def start(name: str) -> ClientLoop:
        loops.append(ClientLoop(name, tmp_path / f"client-{len(loops)}.json"))
        return loops[-1]

    yield start
    for loop in loops:
        if loop.proc.poll() is None:
            loop.proc.kill()


def deploy_source(dag_id: str, export_dir: Path, model: str, repository: str, gate_requests: int,
                  readiness_timeout_s: float = 120) -> str:
    return DEPLOY_DAG.format(dag_id=dag_id, export_dir=export_dir, model=model, repository=repository,
                             gate_requests=gate_requests, readiness_timeout_s=readiness_timeout_s)


def run_in_thread(run_dag, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = run_dag(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict, timeout_s: float) -> dict:
    thread.join(timeout_s)
    assert not thread.is_alive(), "the DAG run did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


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


def ready_versions(model: str) -> list[int]:
    hook = TritonHook("triton_default")
    try:
        return hook.ready_versions(model)
    finally:
        hook.close()


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
    first = run_dag(deploy_source(first_id, make_export(tmp_path / "e1", 1), model_name, repository, 200), first_id)
    assert first["state"] == "success", first["log"][-4000:]
    assert ready_versions(model_name) == [1]

    served = inference_count(model_name, 1)
    loop = client_loop(model_name)
    wait_until("the client's first answers", lambda: inference_count(model_name, 1) > served + 20, timeout_s=30)

    dag_id = f"r_triton_v2_{uuid.uuid4().hex[:6]}"
    broken, gate_requests = PHASES[phase]
    source = deploy_source(dag_id, make_export(tmp_path / "e2", 2, broken), model_name, repository, gate_requests)
    deploy_started = time.monotonic()
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=600)
    try:
        wait_until("version 2 in the version policy", lambda: "versions: [ 1, 2 ]" in (repo.read_config(model_name)
                                                                                        or ""), timeout_s=120)
        if phase.startswith("loading"):
            wait_until("version 2 LOADING", lambda: version_state(model_name, 2) == "LOADING", timeout_s=60)
        else:
            # The smoke test is 1 request of 16 rows; past a few hundred inferences the gate is running.
            wait_until("the latency gate on version 2", lambda: inference_count(model_name, 2) > 500, timeout_s=90)
        state_at_stop = version_state(model_name, 2)
        restart = restart_triton()
        result = joined(thread, box, 400)
    finally:
        if thread.is_alive():
            thread.join(400)
    deploy_s = time.monotonic() - deploy_started
    served = inference_count(model_name, 1)
    wait_until("the client's answers after the rollback", lambda: inference_count(model_name, 1) > served + 20,
               timeout_s=CLIENT_RETRY_S)
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
    first = run_dag(deploy_source(first_id, make_export(tmp_path / "e1", 1), model_name, repository, 200), first_id)
    assert first["state"] == "success", first["log"][-4000:]

    dag_id = f"r_triton_budget_{uuid.uuid4().hex[:6]}"
    source = deploy_source(dag_id, make_export(tmp_path / "e2", 2), model_name, repository, 200,
                           readiness_timeout_s=10)
    thread, box = run_in_thread(run_dag, source, dag_id, timeout_s=300)
    stopped = time.monotonic()
    try:
        wait_until("version 2 LOADING", lambda: version_state(model_name, 2) == "LOADING", timeout_s=120)
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
