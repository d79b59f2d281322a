"""The registry's pure parts: what a model version's tags say, and what a new version's tags carry. The registry
itself runs against the real MLflow server (tests/integration/test_model_registry.py)."""

from __future__ import annotations

import pytest
from hybridflow.pipeline.registry import TAG_MODEL_DIR, TAG_PREVIOUS_CHAMPION, TAG_SHA256, version_record, version_tags


def model_version(**tags) -> dict:
    return {"version": "3", "run_id": "ab" * 16, "source": "runs:/x/model", "aliases": ["champion"],
            "tags": [{"key": k, "value": v} for k, v in tags.items()]}


@pytest.mark.parametrize(("tags", "expected"), [
    ({TAG_MODEL_DIR: "/s/models/p/v3-abc", TAG_SHA256: "abc", "hybridflow.holdout_auc": "0.81",
      TAG_PREVIOUS_CHAMPION: "2"},
     {"export_dir": "/s/models/p/v3-abc", "model_path": "/s/models/p/v3-abc/model.pt", "sha256": "abc", "auc": 0.81,
      "previous_champion": 2}),
    ({}, {"export_dir": None, "model_path": None, "sha256": None, "auc": None, "previous_champion": None}),
    ({"hybridflow.holdout_auc": "None", TAG_PREVIOUS_CHAMPION: ""}, {"auc": None, "previous_champion": None}),
    ({"hybridflow.holdout_auc": "nan?", TAG_PREVIOUS_CHAMPION: "v2"}, {"auc": None, "previous_champion": None}),
], ids=["complete", "no tags", "empty values", "unreadable values"])
def test_a_version_record_reads_its_tags_and_never_guesses(tags, expected):
    record = version_record(model_version(**tags))
    assert record["version"] == 3 and record["aliases"] == ["champion"] and record["run_id"] == "ab" * 16
    assert {key: record[key] for key in expected} == expected


def test_version_tags_keep_what_is_known_verbatim():
    hostile = "x' OR tags.a='1\n<script>"
    tags = version_tags({"airflow_run_id": hostile, "auc": 0.8123, "log_loss": None, "ds": "2026-01-01",
                         "decision": "promote", "reason": "gain 0.01", "ignored": "x"})
    assert tags == {"hybridflow.airflow_run_id": hostile, "hybridflow.holdout_auc": "0.8123",
                    "hybridflow.ds": "2026-01-01", "hybridflow.decision": "promote",
                    "hybridflow.decision_reason": "gain 0.01"}
