"""release_judge: does the release judge roll back what it should, and only that, on a loaded machine?

Against the stack's real guard and Triton, with the release thresholds of include/config/pipeline.yaml
(``serving.release``): a model's version 1 serves; version 2 is released at a canary 50% step, judged by the same
trigger the deploy operator defers to (``TritonReleaseStepTrigger``: the guard's figures of both versions since
the step began, ``utils.release.judge``), while ``CLIENTS`` threads send unversioned requests through the guard.
Each step ends pass, fail (a rollback), held or no_traffic; then the release goes back to version 1 for the next.

Three candidates, ``TRIALS`` steps each (env ``RELEASE_JUDGE_TRIALS``, default 20), all while a CPU hog keeps
every core busy (one spinning process per core, the machine the issue saw a false rollback on):
- identical: version 1's weights retrained within 0.01 (another file, the same answers): every rollback is false;
- slow: the identical model's python backend sleeping twice the median latency the clients saw in the identical
  phase, per batch: about 3x slower, to be rolled back;
- shifted: version 1's bias raised by 1.5 (its scores drift up): to be rolled back.
Goals: 0 false rollbacks of ``identical``, at least 19 of 20 rollbacks of each bad one.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test suite's model builders (helpers.triton_models)

TRIALS = int(os.environ.get("RELEASE_JUDGE_TRIALS", "20"))
CLIENTS = 4
SHARE = 50
STEP_TIMEOUT_S = 90  # a step's limit here: room for the samples p99 needs at this traffic


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


class Client(threading.Thread):
    """Unversioned requests for ``model`` through the guard until stopped; answer latencies in ms."""

    def __init__(self, model: str, rows: list[list[float]]):
        super().__init__(daemon=True)
        self.model, self.rows, self.stopped, self.latencies_ms, self.errors = model, rows, threading.Event(), [], 0

    def run(self) -> None:
        from helpers.triton_models import TRITON_HTTP

        noise = random.Random(threading.get_ident())
        while not self.stopped.is_set():
            # real traffic is not 16 fixed rows: each request a smoke row perturbed, as the demo's client sends
            row = [value + noise.gauss(0, 0.1) for value in noise.choice(self.rows)]
            body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, len(row)],
                                           "data": row}]}).encode()
            started = time.perf_counter()
            try:
                request = urllib.request.Request(f"http://{TRITON_HTTP}/v2/models/{self.model}/infer", data=body)
                with urllib.request.urlopen(request, timeout=30) as answer:
                    answer.read()
                self.latencies_ms.append((time.perf_counter() - started) * 1000)
            except OSError:
                self.errors += 1


def clients(model: str, rows: list[list[float]]) -> list[Client]:
    started = [Client(model, rows) for _ in range(CLIENTS)]
    for client in started:
        client.start()
    return started


def stop(running: list[Client]) -> tuple[list[float], int]:
    for client in running:
        client.stopped.set()
    for client in running:
        client.join(timeout=60)
    return [v for c in running for v in c.latencies_ms], sum(c.errors for c in running)


def serve(repository: str, model: str, exports: dict[int, Path], slow_ms: float | None = None) -> None:
    """Versions 1 and 2 published and loaded, version 1 promoted and routed; version 2 sleeping ``slow_ms``."""
    from helpers.triton_models import N_FEATURES, publish_and_serve, publish_slow_version
    from hybridflow.config import ReleaseConfig
    from hybridflow.hooks.triton import TritonHook
    from hybridflow.operators.triton import TritonDeployOperator

    if slow_ms is None:
        publish_and_serve(repository, model, exports)
    else:
        publish_and_serve(repository, model, {1: exports[1]}, serve=(1,))
        assert publish_slow_version(repository, model, exports[2], sleep_ms=slow_ms) == 2
        operator = TritonDeployOperator(task_id="bench", export_dir="/unused", model_name=model,
                                        repository=repository, release=ReleaseConfig(strategy="direct"))
        operator.serve_versions(N_FEATURES, (1, 2))
        operator.hook.close()
    hook = TritonHook("triton_default")
    hook.set_release(model, 1)
    hook.close()


def step(model: str, release) -> dict:
    """One canary step of version 2 judged to its end; the release set back to version 1 after."""
    from hybridflow.hooks.triton import TritonHook
    from hybridflow.triggers.triton import TritonReleaseStepTrigger

    hook = TritonHook("triton_default")
    try:
        generation = hook.set_release(model, 1, 2, mode="canary", share=SHARE)["generation"]
        trigger = TritonReleaseStepTrigger("triton_default", model, generation, asdict(release.thresholds()),
                                           min_window_s=release.step_min_s, timeout_s=STEP_TIMEOUT_S,
                                           poll_interval_s=1.0)
        event = asyncio.run(trigger.wait())
        hook.set_release(model, 1)
        return event
    finally:
        hook.close()


def phase(name: str, repository: str, exports: dict[int, Path], rows, release, slow_ms: float | None = None) -> dict:
    from helpers.triton_models import remove_model
    from hybridflow.utils.latency import percentile

    model = f"bench_judge_{name}_{uuid.uuid4().hex[:6]}"
    serve(repository, model, exports, slow_ms)
    outcomes: dict[str, int] = {}
    seconds, reasons, ratios = [], [], []
    running = clients(model, rows)
    try:
        for trial in range(TRIALS):
            event = step(model, release)
            outcomes[event["status"]] = outcomes.get(event["status"], 0) + 1
            seconds.append(event["seconds"])
            if (event.get("verdict") or {}).get("figures", {}).get("p50_ratio_low") is not None:
                ratios.append(event["verdict"]["figures"]["p50_ratio_low"])
            if event["status"] != "pass":
                reasons.append(event["message"][:300])
            print(f"  {name} {trial + 1}/{TRIALS}: {event['status']} after {event['seconds']} s: "
                  f"{event['message'][:200]}", flush=True)
    finally:
        latencies, errors = stop(running)
        remove_model(repository, model)
    return {"outcomes": outcomes, "rolled_back": outcomes.get("fail", 0), "trials": TRIALS,
            "median_step_s": round(percentile(seconds, 50), 1), "client_requests": len(latencies) + errors,
            "client_errors": errors, "client_p50_ms": round(percentile(latencies, 50), 2) if latencies else None,
            "client_p99_ms": round(percentile(latencies, 99), 1) if latencies else None,
            "p50_ratio_low_median": round(percentile(ratios, 50), 2) if ratios else None,
            "reasons": reasons[:5]}


def main() -> dict:
    from bench_triton import stack_environment
    from helpers.triton_models import make_export
    from hybridflow.config import load_pipeline_config

    stack_environment()
    config = load_pipeline_config()
    release, repository = config.serving.release, config.serving.repository
    stop_hog = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=spin, args=(stop_hog,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for process in hogs:
        process.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = make_export(Path(tmp) / "v1", 1)
            rows = json.loads((base / "smoke.json").read_text())["inputs"]
            identical = make_export(Path(tmp) / "identical", 1, kind="close", variant=1)
            shifted = make_export(Path(tmp) / "shifted", 1, kind="shifted")

            identical_phase = phase("identical", repository, {1: base, 2: identical}, rows, release)
            # The slow candidate sleeps twice the median latency the clients saw in the identical phase (the same
            # hog, the same split): about 3x slower where its answers are concerned.
            stable_p50_ms = identical_phase["client_p50_ms"]
            slow_ms = round(2 * stable_p50_ms, 2)
            print(f"client p50 in the identical phase: {stable_p50_ms:.2f} ms; the slow candidate sleeps {slow_ms} "
                  "ms", flush=True)
            results = {"identical": identical_phase,
                       "slow": phase("slow", repository, {1: base, 2: identical}, rows, release, slow_ms=slow_ms),
                       "shifted": phase("shifted", repository, {1: base, 2: shifted}, rows, release)}
    finally:
        stop_hog.set()
        for process in hogs:
            process.join(timeout=10)
    figures = {
        "trials": TRIALS, "hog_processes": len(hogs), "client_p50_ms_under_hog": stable_p50_ms,
        "slow_sleep_ms": slow_ms,
        "identical_false_rollbacks": results["identical"]["rolled_back"],
        "identical_held": results["identical"]["outcomes"].get("held", 0),
        "identical_no_traffic": results["identical"]["outcomes"].get("no_traffic", 0),
        "slow_rolled_back": results["slow"]["rolled_back"],
        "slow_p50_ratio_low_median": results["slow"]["p50_ratio_low_median"],
        "shifted_rolled_back": results["shifted"]["rolled_back"],
        "median_step_s": results["identical"]["median_step_s"],
    }
    figures["goal_met"] = (figures["identical_false_rollbacks"] == 0 and figures["slow_rolled_back"] >= TRIALS - 1
                           and figures["shifted_rolled_back"] >= TRIALS - 1)
    print(json.dumps(results, indent=1))
    print("RESULT release_judge " + " ".join(f"{k}={v}" for k, v in figures.items()))
    return {**figures, "phases": results}


if __name__ == "__main__":
    main()
