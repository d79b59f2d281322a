#!/usr/bin/env python3
"""Trigger a DAG on the running local Airflow through its REST API and follow it to the end.

    .venv/bin/python scripts/demo.py [--dag DAG_ID] [--conf JSON] [--timeout SECONDS]

Prints one line per task state change and a summary; exits non-zero when the run fails. `make demo` runs it
after `make up`; the Airflow UI stays up until `make down`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from airflow_api import AirflowApi, local_api, trigger

DEFAULT_DAG = "platform_healthcheck"


def follow(api: AirflowApi, dag_id: str, run_id: str, timeout_s: float) -> str:
    seen: dict[str, str] = {}
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        for ti in sorted(tis, key=lambda t: t.get("start_date") or "~"):
            state = ti.get("state") or "none"
            if seen.get(ti["task_id"]) != state:
                seen[ti["task_id"]] = state
                took = f" ({ti['duration']:.1f} s)" if ti.get("duration") else ""
                print(f"[{time.monotonic() - started:6.1f} s] {ti['task_id']:<40} {state}{took}", flush=True)
        run = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run["state"]
        time.sleep(2)
    raise RuntimeError(f"run {run_id} of {dag_id} did not finish within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dag", default=DEFAULT_DAG)
    parser.add_argument("--conf", default="{}", help="run conf as JSON (the DAG's params)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)

    api = local_api()
    t0 = time.monotonic()
    run_id = trigger(api, args.dag, json.loads(args.conf))
    print(f"triggered {args.dag} run {run_id}", flush=True)
    state = follow(api, args.dag, run_id, args.timeout)
    print()
    print(f"{args.dag}: {state.upper()} in {time.monotonic() - t0:.0f} s")
    print(f"UI: {api.base_url}/dags/{args.dag}/runs/{run_id}  (login admin, password in "
          ".state/airflow/passwords.json)")
    print("The stack keeps running; `make down` stops it.")
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
