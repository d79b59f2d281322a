"""A run's deadline on the running stack, end to end through Airflow's own machinery: the scheduler records the
deadline when deadline_probe's run is queued (15 s, the same run_deadline as nightly_training's deadline_min),
and when it passes the triggerer runs the callback, which reads the run's task states and alerts on-call through
the configured sink with the stage it is in. A run of the same DAG that ends in time is not alerted."""

from __future__ import annotations

import json
import time

from airflow_api import trigger, wait_for_run
from helpers.rest import call
from hybridflow.notifiers.oncall import default_alerts_file

DAG = "deadline_probe"


def alerts_of(run_id: str) -> list[dict]:
    path = default_alerts_file()
    if not path.exists():
        return []
    return [alert for alert in map(json.loads, path.read_text().splitlines())
            if alert["dag_id"] == DAG and alert["run_id"] == run_id]


def test_a_run_past_its_deadline_alerts_on_call_with_its_stage_and_one_in_time_does_not(api, stack, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", stack["HYBRIDFLOW_STORAGE_ROOT"])
    late = trigger(api, DAG, {"sleep_s": 120})
    in_time = trigger(api, DAG, {"sleep_s": 1})
    try:
        deadline = time.monotonic() + 120
        while not (sent := alerts_of(late)) and time.monotonic() < deadline:
            time.sleep(1)
        assert sent, f"no alert for run {late} within 120 s of a 15 s deadline"
        alert = sent[0]
        assert alert["kind"] == "late" and alert["stage"] == "sleep_past_the_deadline"
        assert alert["error"].startswith("not done 0.25 min after it was queued at ")
        assert alert["error"].endswith("stage sleep_past_the_deadline (sleep_past_the_deadline: running)")
        assert "[hybridflow] LATE deadline_probe / stage sleep_past_the_deadline" in alert["text"]
        assert "0 of 1 tasks done" in alert["log_tail"]
        assert wait_for_run(api, DAG, in_time, timeout_s=60) == "success"
        assert alerts_of(in_time) == []  # ended before its deadline: Airflow dropped it
        assert len(alerts_of(late)) == 1
    finally:
        call(api, "PATCH", f"/api/v2/dags/{DAG}/dagRuns/{late}", {"state": "failed"})
