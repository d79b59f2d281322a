"""Load on the running local Airflow (metadata in PostgreSQL): 50 REST triggers at once, and a burst of 20 runs
of a short GPU-job DAG, all started at once.

The probe DAG's Slurm task sits in the ``gpu_training`` pool (1 slot, deferred tasks counted), as the nightly
training task does. Checks: every run succeeds, each has exactly one Slurm job, the GPU partition never ran more
jobs of the burst at once than the pool has slots, and the scheduler overhead (Slurm job end -> Airflow task
success) is measured and printed as a ``RELIABILITY load`` line.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
from airflow_api import wait_for_dag, wait_for_run
from hybridflow.utils.slurm import deterministic_job_name

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
PROBE_DAG = "reliability_probe"
PROBE_TASK = "sleep_job"
RUNS = 20
TRIGGERS = 50


def concurrently(calls: list) -> list[tuple[int, object]]:
    """Each call on its own thread (and so its own HTTP connection), all at once: (HTTP status, result) each."""
    def one(call):
        try:
            return 200, call()
        except RuntimeError as exc:  # the client's HTTP errors: "... -> HTTP 500: ..."
            cause = exc.__cause__
            return (cause.code if isinstance(cause, urllib.error.HTTPError) else 599), str(exc)

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(one, calls))


def accounted_jobs(names: list[str]) -> list[dict]:
    """The burst's jobs as Slurm accounted them, times as epoch seconds (SLURM_TIME_FORMAT=%s)."""
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook()
    try:
        out = hook.run(["env", "SLURM_TIME_FORMAT=%s", "sacct", "-X", "-P", "-n", "--starttime=now-1days",
                        f"--name={','.join(names)}", "--format=JobID,JobName,Partition,State,Start,End"]).stdout
    finally:
        hook.close()
    jobs = []
    for line in out.splitlines():
        job_id, name, partition, state, start, end = line.split("|")
        jobs.append({"id": job_id, "name": name, "partition": partition, "state": state.split()[0],
                     "start": int(start), "end": int(end)})
    return jobs


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The largest number of [start, end) intervals that overlap at one moment."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in events:  # at equal times an end (-1) sorts before a start (+1): back-to-back is not overlap
        running += change
        peak = max(peak, running)
    return peak


def trigger_at_once(api, runs: int, sleep_s: int) -> list[tuple[int, dict]]:
    """``runs`` POSTs of a reliability_probe run, all at once: (HTTP status, body) of each."""
    return concurrently([lambda: api.post(f"/api/v2/dags/{PROBE_DAG}/dagRuns",
                                          {"logical_date": None, "conf": {"sleep_s": sleep_s}})
                         for _ in range(runs)])


def test_most_at_once_counts_overlaps_not_back_to_back_jobs():
    assert most_at_once([(0, 5), (5, 9), (9, 12)]) == 1
    assert most_at_once([(0, 5), (4, 9), (8, 12)]) == 2
    assert most_at_once([(0, 10), (1, 2), (3, 4)]) == 2


def test_fifty_rest_triggers_at_once_get_no_server_error(api):
    """50 POSTs of a DAG run at once (SQLite answered some of these with HTTP 500 "Database error" after a 5 s
    lock wait): every one 200, each a run of its own; then each run deleted, again at once, with no error. The DAG
    stays paused, so the runs only exercise the API and the metadata database."""
    wait_for_dag(api, PROBE_DAG)
    api.patch(f"/api/v2/dags/{PROBE_DAG}", {"is_paused": True})
    started = time.monotonic()
    posted = trigger_at_once(api, TRIGGERS, sleep_s=1)
    post_s = time.monotonic() - started
    run_ids = [body["dag_run_id"] for status, body in posted if status == 200]
    deleted = concurrently([lambda run_id=run_id: api.delete(f"/api/v2/dags/{PROBE_DAG}/dagRuns/{run_id}")
                            for run_id in run_ids])
    errors = [(status, body) for status, body in posted + deleted if status != 200]
    print(f"RELIABILITY rest_burst posts={TRIGGERS} ok={len(run_ids)} distinct_runs={len(set(run_ids))} "
          f"deleted={sum(status == 200 for status, _ in deleted)} server_errors="
          f"{sum(status >= 500 for status, _ in posted + deleted)} post_wall_s={post_s:.1f}", flush=True)
    assert not errors, errors[:5]
    assert len(set(run_ids)) == TRIGGERS


def test_burst_of_twenty_runs_all_finish_without_duplicates_or_oversubscribing_the_gpu_pool(api):
    """Injected: 20 runs triggered at once (20 concurrent POSTs). Survives: all of them, one Slurm job each,
    never more GPU jobs at once than the pool's slots. Measured: Slurm job end -> task success, median and p95."""
    slots = json.loads((REPO / "include/config/pools.json").read_text())["gpu_training"]["slots"]
    wait_for_dag(api, PROBE_DAG)
    api.patch(f"/api/v2/dags/{PROBE_DAG}", {"is_paused": False})
    started = time.monotonic()
    posted = trigger_at_once(api, RUNS, sleep_s=2)
    assert all(status == 200 for status, _ in posted), [p for p in posted if p[0] != 200][:5]
    run_ids = [body["dag_run_id"] for _, body in posted]
    states = {run_id: wait_for_run(api, PROBE_DAG, run_id, timeout_s=900, poll_s=2) for run_id in run_ids}
    wall_s = time.monotonic() - started
    assert set(states.values()) == {"success"}, states

    names = {deterministic_job_name(PROBE_DAG, PROBE_TASK, run_id): run_id for run_id in run_ids}
    jobs = accounted_jobs(list(names))
    per_run = {run_id: [job for job in jobs if names[job["name"]] == run_id] for run_id in run_ids}
    duplicates = {run_id: found for run_id, found in per_run.items() if len(found) != 1}
    assert not duplicates, f"runs without exactly one Slurm job: {duplicates}"
    assert {job["state"] for job in jobs} == {"COMPLETED"}

    peak = most_at_once([(job["start"], job["end"]) for job in jobs if job["partition"] == "gpu-training"])
    assert peak <= slots, f"{peak} GPU jobs of the burst ran at once; the gpu_training pool has {slots} slot(s)"

    overheads = []
    for run_id, (job,) in per_run.items():
        ti = api.get(f"/api/v2/dags/{PROBE_DAG}/dagRuns/{run_id}/taskInstances/{PROBE_TASK}")
        task_end = datetime.fromisoformat(ti["end_date"]).timestamp()
        overheads.append(task_end - job["end"])
    overheads.sort()
    median = statistics.median(overheads)
    p95 = overheads[max(0, round(0.95 * len(overheads)) - 1)]
    print(f"RELIABILITY load runs={RUNS} wall_s={wall_s:.0f} jobs={len(jobs)} max_gpu_jobs_at_once={peak} "
          f"pool_slots={slots} overhead_median_s={median:.1f} overhead_p95_s={p95:.1f}", flush=True)
    # Slurm's End has one-second resolution; anything else below -1 s would mean the clocks disagree.
    assert overheads[0] > -1.0, overheads
