"""The late-run alert, by table: the stage of the first unfinished task (running before queued), every
unfinished task with its state, what is done and what failed; and the nightly DAG's deadline from config."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hybridflow.config import load_pipeline_config
from hybridflow.notifiers.deadline import late_alert

NOW = datetime(2026, 12, 5, 6, 0, tzinfo=UTC)
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "states, stage, error_end, details",
    [
        ({"features.build_features": "success", "training.train": "deferred", "scoring.score_batch": None},
         "training", "stage training (training.train: deferred)", ["training.train: deferred", "1 of 3 tasks done"]),
        ({"deploy.approve_release": "awaiting_input", "report.write_report": "scheduled"}, "deploy",
         "stage deploy (deploy.approve_release: awaiting_input)",
         ["deploy.approve_release: awaiting_input", "report.write_report: scheduled", "0 of 2 tasks done"]),
        ({"scoring.score_batch": "queued", "training.train": "running", "quality.quality_gate": "failed"},
         "training", "stage training (training.train: running)",
         ["training.train: running", "scoring.score_batch: queued", "0 of 3 tasks done; failed: quality.quality_gate"]),
        ({}, "nightly_training", "no task running (the run waits to be scheduled)", ["0 of 0 tasks done"]),
    ],
)
def test_a_late_run_is_alerted_with_the_stage_it_is_in(states, stage, error_end, details):
    alert = late_alert("nightly_training", "scheduled__2026-12-05T02:00:00+00:00", states, 4 * 3600,
                       "2026-12-05T02:00:03Z", NOW)
    assert alert.kind == "late" and alert.stage == stage
    assert alert.error == f"not done 240 min after it was queued at 2026-12-05T02:00:03Z: {error_end}"
    assert alert.log_tail.splitlines() == details
    assert alert.dedup_key == f"late:nightly_training:{stage}:scheduled__2026-12-05T02:00:00+00:00"
    assert alert.text().startswith(f"[hybridflow] LATE nightly_training / stage {stage}")


def test_the_nightly_has_the_configured_deadline_after_it_is_queued():
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import AsyncCallback

    bag = DagBag(dag_folder=str(REPO / "dags" / "nightly_training.py"))
    deadlines = bag.dags["nightly_training"].deadline
    alert = deadlines[0] if isinstance(deadlines, list) else deadlines
    minutes = load_pipeline_config().nightly.deadline_min
    assert alert.interval == timedelta(minutes=minutes) and type(alert.reference).__name__ == "DagRunQueuedAtDeadline"
    assert isinstance(alert.callback, AsyncCallback)
    assert alert.callback.path == "hybridflow.notifiers.deadline.missed_deadline"
    assert alert.callback.kwargs["deadline_s"] == minutes * 60
