#!/usr/bin/env python3
"""Run the nightly pipeline for a date on the running local Airflow, through its REST API, and summarise it.

    .venv/bin/python scripts/demo.py [--ds YYYY-MM-DD] [--conf JSON] [--timeout SECONDS]
    .venv/bin/python scripts/demo.py --dag platform_healthcheck

Makes sure the cluster preflight (all-reduce benchmark) is fresh, triggers `nightly_training`, prints one line
per task state change, and ends with a summary: rows, holdout metrics, checkpoint, the model version Triton
serves with a sample realtime prediction and its latency, the release's phases (shadow, canary steps, with the
figures each was judged on), the report, and the UI URL and login. Exits non-zero when a run fails.

While the nightly runs, a client keeps asking Triton for the model it serves (rows of the served version's smoke
set, perturbed; about 40 requests per second): the traffic a progressive release judges a new version on. On a
stack serving no version yet, the first deploy has nothing to compare against and is promoted after its gates.
`make demo` runs it after `make up`; the stack keeps running until `make down`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from airflow_api import STATE
from airflow_session import Airflow, local_airflow
from hybridflow.utils.latency import percentile

NIGHTLY = "nightly_training"
DEMO_GPUS = 2
TRITON = "http://127.0.0.1:8000"


# What Triton (and the guard) say of a model no version of which is loaded yet: the request was early, not failed.
NOT_SERVED_MARKERS = ("unknown model", "is not found", "not ready", "no version", "unavailable")


def not_served_yet(status: int, body: str) -> bool:
    """A refusal because nothing serves the model yet (HTTP 400/404/503 saying so), not an error of a version."""
    return status in (400, 404, 503) and any(marker in body.lower() for marker in NOT_SERVED_MARKERS)


@dataclass
class Tally:
    """The client's requests: answers (and latencies) per version, requests before any version served, errors."""

    answers: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    not_served: int = 0
    errors: int = 0

    def summary(self) -> str:
        """``answers by version 1: 639, version 2: 80; 0 errors; 119 sent before any version served; p99 4.1 ms
        of 719``."""
        answered = ", ".join(f"version {v}: {n}" for v, n in sorted(self.answers.items(), key=lambda kv: int(kv[0])))
        p99 = (f"p99 {percentile(self.latencies_ms, 99):.1f} ms of {len(self.latencies_ms)}" if self.latencies_ms
               else "no latency")
        return (f"answers by {answered or 'no version'}; {self.errors} errors; {self.not_served} sent before any "
                f"version served (not served yet); {p99}")


class Traffic(threading.Thread):
    """Unversioned requests for ``model`` until stopped, tallied (:class:`Tally`): rows of the served version's
    smoke set (real feature rows of its export), each slightly perturbed."""

    def __init__(self, model: str, repository: Path):
        super().__init__(daemon=True)
        self.model, self.repository = model, repository
        self.stopped, self.tally = threading.Event(), Tally()

    def rows(self) -> list[list[float]]:
        versions = sorted((p for p in (self.repository / self.model).glob("[0-9]*/smoke.json")),
                          key=lambda p: int(p.parent.name))
        return json.loads(versions[-1].read_text())["inputs"] if versions else []

    def run(self) -> None:
        noise = random.Random(0)
        while not self.stopped.wait(0.025):
            try:
                rows = self.rows()
            except (OSError, ValueError, KeyError):
                rows = []
            if not rows:
                self.stopped.wait(5)  # nothing served yet: look again later
                continue
            for _ in range(400):  # the rows read again now and then: a new version may take other features
                if self.stopped.wait(0.02):
                    return
                row = [value + noise.gauss(0, 0.1) for value in noise.choice(rows)]
                body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, len(row)],
                                               "data": row}]}).encode()
                started = time.perf_counter()
                try:
                    request = urllib.request.Request(f"{TRITON}/v2/models/{self.model}/infer", data=body)
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        version = str(json.load(answer)["model_version"])
                    self.tally.latencies_ms.append((time.perf_counter() - started) * 1000)
                    self.tally.answers[version] = self.tally.answers.get(version, 0) + 1
                except urllib.error.HTTPError as refused:
                    if not_served_yet(refused.code, refused.read().decode(errors="replace")):
                        self.tally.not_served += 1
                        self.stopped.wait(1)  # published but not loaded yet: ask again in a moment
                    else:
                        self.tally.errors += 1
                    break
                except (OSError, ValueError, KeyError):
                    self.tally.errors += 1
                    break


def release_lines(deploy: dict) -> list[str]:
    """The release's phases as the deploy judged them."""
    release = deploy.get("release") or {}
    if not release:
        return [f"release: version {deploy.get('version')} promoted after its gates (no version served before it, "
                "or serving.release.strategy: direct)"] if deploy.get("promoted") else []
    lines = []
    for step in release.get("steps") or []:
        figures = step.get("figures") or {}
        phase = "shadow" if step["mode"] == "shadow" else f"canary {step['share']}%"
        shown = ", ".join(f"{k} {figures[k]}" for k in ("requests", "stable_requests", "errors", "p99_ms",
                                                          "stable_p99_ms", "p50_ratio_low", "p99_ratio_low",
                                                          "mean_shift", "psi") if k in figures)
        lines.append(f"release: {phase}: {step['outcome']} after {step.get('seconds')} s ({shown})"
                     + (f"; {'; '.join(step['reasons'])}" if step.get("reasons") else ""))
    if release.get("no_traffic"):
        lines.append("release: too little traffic to judge: promoted on the gates (serving.release.no_traffic)")
    return lines


def follow(airflow: Airflow, dag_id: str, run_id: str, timeout_s: float) -> str:
    seen: dict[str, str] = {}
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        tis = airflow.task_instances_of(dag_id, run_id)
        for ti in sorted(tis, key=lambda t: t.start_date.isoformat() if t.start_date else "~"):
            state = ti.state.value if ti.state else "none"
            if seen.get(ti.task_id) != state:
                seen[ti.task_id] = state
                took = f" ({ti.duration:.1f} s)" if ti.duration else ""
                print(f"[{time.monotonic() - started:6.1f} s] {ti.task_id:<40} {state}{took}", flush=True)
        state = airflow.run_state(dag_id, run_id)
        if state in ("success", "failed"):
            return state
        time.sleep(2)
    raise RuntimeError(f"run {run_id} of {dag_id} did not finish within {timeout_s:.0f} s")


def run_dag(airflow: Airflow, dag_id: str, conf: dict, timeout_s: float, logical_date: str | None = None) -> tuple:
    run_id = airflow.trigger(dag_id, conf, logical_date=logical_date)
    print(f"triggered {dag_id} run {run_id}", flush=True)
    return run_id, follow(airflow, dag_id, run_id, timeout_s)


def ensure_fresh_preflight(airflow: Airflow, storage_root: str, timeout_s: float, nodes: int = 1,
                           gpus_per_node: int = DEMO_GPUS) -> None:
    """Training refuses a stale, failed or missing all-reduce preflight of its own topology: run it when needed."""
    if nodes * gpus_per_node == 1:
        return  # one rank all-reduces nothing; the gate lets it through
    latest = Path(storage_root) / "runs" / "preflight" / f"{nodes}x{gpus_per_node}" / "latest.json"
    try:
        measured = datetime.fromisoformat(json.loads(latest.read_text())["measured_at"])
        if datetime.now(UTC) - measured < timedelta(days=1):
            print(f"cluster preflight ({nodes}x{gpus_per_node}) measured {measured:%Y-%m-%d %H:%M} UTC: fresh",
                  flush=True)
            return
    except (OSError, KeyError, ValueError):
        pass
    _, state = run_dag(airflow, "cluster_preflight", {"nodes": nodes, "gpus_per_node": gpus_per_node}, timeout_s)
    if state != "success":
        raise SystemExit("cluster_preflight failed: training would be refused; see its log "
                         "(runbook: include/runbooks/preflight.md)")


def sample_prediction(model_name: str, export_dir: str) -> str:
    """One realtime request to Triton with the model's own smoke rows, timed end to end."""
    import numpy as np
    import tritonclient.http as httpclient

    smoke = json.loads((Path(export_dir) / "smoke.json").read_text())
    row = np.asarray(smoke["inputs"][:1], dtype=np.float32)
    client = httpclient.InferenceServerClient("127.0.0.1:8000")
    tensor = httpclient.InferInput(smoke["input_name"], list(row.shape), "FP32")
    tensor.set_data_from_numpy(row, binary_data=True)
    timings = []
    for _ in range(20):
        started = time.perf_counter()
        result = client.infer(model_name, [tensor])
        timings.append((time.perf_counter() - started) * 1000)
    score = float(result.as_numpy(smoke["output_name"]).reshape(-1)[0])
    return (f"p(convert)={score:.4f} for customer row 0 of the smoke set (expected "
            f"{smoke['outputs'][0][0]:.4f}); latency median {sorted(timings)[10]:.2f} ms over 20 requests")


def nightly_summary(airflow: Airflow, run_id: str, storage_root: str) -> list[str]:
    def get(task_id: str):
        return airflow.xcom(NIGHTLY, run_id, task_id) or {}

    lines = []
    placement = get("preflight.plan").get("placement") or {}
    if placement:
        lines.append(f"placement: {placement.get('reason')}")
    figures = get("quality.quality_gate").get("figures") or {}
    if figures:
        lines.append(f"features: {figures.get('raw_rows')} raw rows -> {figures.get('feature_rows')} customers, "
                     f"{figures.get('quarantined_rows')} quarantined ({figures.get('quarantine_ratio')})")
    train = get("training.train")
    if train:
        metrics = train.get("metrics") or {}
        lines.append(f"training: Slurm job {train.get('job_id')} {train.get('state')} in "
                     f"{train.get('elapsed_s')} s, step {metrics.get('step')}, holdout AUC "
                     f"{metrics.get('auc')}, log loss {metrics.get('log_loss')}")
        lines.append(f"ranks: {metrics.get('world_size')} on {metrics.get('nodes')} node(s) "
                     f"[{', '.join(metrics.get('ranks') or [])}], ZeRO-{metrics.get('zero_stage')}; all-reduce share "
                     f"in the job {metrics.get('allreduce_share_in_job')}")
        lines.append(f"checkpoint: {train.get('run_dir')}/checkpoints (newest complete: step {metrics.get('step')})")
        if train.get("efficiency"):
            from hybridflow.utils.efficiency import describe_efficiency

            lines.append(f"job efficiency (Slurm accounting): {describe_efficiency(train['efficiency'])}")
        if (train.get("mlflow") or {}).get("url"):
            lines.append(f"MLflow run: {train['mlflow']['url']}")
    decision = get("evaluation.champion_challenger")
    if decision:
        lines.append(f"evaluation: {decision.get('reason')}")
        if decision.get("model_uri"):
            lines.append(f"registry: trained model is {decision['model_uri']} (alias challenger)")
    scoring = get("scoring.model_of_record")
    predictions = Path(storage_root) / "predictions"
    if scoring:
        lines.append(f"champion: {scoring.get('version_uri')} ({scoring.get('uri')})")
        lines.append(f"scoring: model of record {scoring.get('version')} -> {predictions}")
    # a release held for approval (deploy=ask) ends in finish_release, as the person decided
    deploy = (get("deploy.finish_release") or get("deploy.deploy_model")
              or airflow.xcom(NIGHTLY, run_id, "deploy.deploy_model", "deploy_report") or {})
    if deploy:
        latency = deploy.get("latency") or {}
        lines.append(f"serving: Triton model {deploy.get('model')} version {deploy.get('version')} "
                     f"(promoted={deploy.get('promoted')}), gate p50 {latency.get('p50_ms')} ms, p99 "
                     f"{latency.get('p99_ms')} ms; serves {deploy.get('model_uri') or 'no registry version'}")
        lines.extend(release_lines(deploy))
    if scoring and scoring.get("export_dir"):
        try:
            lines.append("realtime: " + sample_prediction(deploy.get("model") or "propensity", scoring["export_dir"]))
        except Exception as error:  # the summary reports what it could not measure instead of failing
            lines.append(f"realtime: no sample prediction ({error})")
    report = get("report.write_report")
    if report:
        lines.append(f"report: {report.get('html') or report}")
    return lines


def ledger_lines(airflow: Airflow, storage_root: str, timeout_s: float) -> list[str]:
    """Today's GPU partition ledger so far (the cluster_utilization DAG), with the nightly run's jobs in it."""
    today = date.today().isoformat()
    run_id, state = run_dag(airflow, "cluster_utilization", {"start_day": today}, timeout_s)
    if state != "success":
        return [f"ledger: cluster_utilization {state} (runbook: include/runbooks/utilization.md)"]
    lines = []
    for item in airflow.xcom("cluster_utilization", run_id, "ledger") or []:
        row = json.loads(Path(item["path"]).read_text())
        utilization = row["utilization"]
        top = ", ".join(f"{dag} {hours:.3f}" for dag, hours in list(row["by_dag"].items())[:3]) or "none"
        lines.append(f"ledger {row['partition']} {row['day']} so far: "
                     f"{'not measured' if utilization is None else f'{utilization:.1%}'} of "
                     f"{row['available_gpu_hours']:.1f} available GPU-hours allocated "
                     f"({row['allocated_gpu_hours']:.3f}, {row['jobs']} jobs; by DAG: {top}); page: "
                     f"{airflow.base_url}/hybridflow/utilization")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dag", default=NIGHTLY)
    parser.add_argument("--ds", default=None, help="the date to run (default: yesterday, UTC)")
    parser.add_argument("--conf", default="{}", help="run conf as JSON (the DAG's params)")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args(argv)

    env = json.loads((STATE / "airflow-env.json").read_text())
    storage_root = env.get("HYBRIDFLOW_STORAGE_ROOT", "/var/lib/hybridflow/storage")
    airflow = local_airflow()
    t0 = time.monotonic()
    logical_date = None
    conf = json.loads(args.conf)
    if args.dag == NIGHTLY:
        # The demo trains data-parallel on the GPU partition: two ranks (two emulated GPUs) unless --conf says
        # otherwise (device=auto would put the small preset on the CPU partition: pipeline.yaml placement).
        conf.setdefault("gpus_per_node", DEMO_GPUS)
        conf.setdefault("device", "gpu")
        ensure_fresh_preflight(airflow, storage_root, args.timeout, conf.get("nodes", 1), conf["gpus_per_node"])
        ds = date.fromisoformat(args.ds) if args.ds else date.today() - timedelta(days=1)
        # A fresh timestamp on the requested day: the run's ds is that day, and a rerun is a new run of it.
        now = datetime.now(UTC)
        logical_date = datetime(ds.year, ds.month, ds.day, now.hour, now.minute, now.second, now.microsecond,
                                tzinfo=UTC).isoformat()
    traffic = Traffic(os.environ.get("HYBRIDFLOW_DEMO_MODEL", "propensity"), Path(storage_root) / "model-repository")
    if args.dag == NIGHTLY:
        traffic.start()
    try:
        run_id, state = run_dag(airflow, args.dag, conf, args.timeout, logical_date)
    finally:
        traffic.stopped.set()
    print()
    print(f"{args.dag}: {state.upper()} in {time.monotonic() - t0:.0f} s")
    if args.dag == NIGHTLY:
        for line in nightly_summary(airflow, run_id, storage_root) + ledger_lines(airflow, storage_root, args.timeout):
            print(f"  {line}")
        print(f"  client during the run: {traffic.tally.summary()}")
    print(f"UI: {airflow.base_url}/dags/{args.dag}/runs/{run_id}  (login admin, password in "
          f"{os.path.relpath(STATE / 'airflow' / 'passwords.json')})")
    print("The stack keeps running; `make down` stops it.")
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
