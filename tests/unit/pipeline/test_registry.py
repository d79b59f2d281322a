"""The registry's pure parts: what a model version's tags say, and what a new version's tags carry. The registry
itself runs against the real MLflow server (tests/integration/test_model_registry.py)."""

from __future__ import annotations

import pytest
from hybridflow.pipeline.registry import (
    TAG_MODEL_DIR,
    TAG_PREVIOUS_CHAMPION,
    TAG_SHA256,
    RegistryError,
    deploy_tags,
    parse_version_uri,
    scoring_tags,
    version_record,
    version_tags,
)


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


@pytest.mark.parametrize(("uri", "expected"), [
    ("models:/propensity/1", ("propensity", 1)),
    ("models:/a-b_C9/4294967296", ("a-b_C9", 4294967296)),
    ("models:/" + "m" * 64 + "/2", ("m" * 64, 2)),
])
def test_a_version_uri_names_a_registered_model_and_a_version(uri, expected):
    assert parse_version_uri(uri) == expected


@pytest.mark.parametrize("uri", [
    "", "models:/propensity", "models:/propensity/0", "models:/propensity/01", "models:/propensity/-1",
    "models:/propensity@champion", "models:/../1", "models:/a/b/1", "models:/propensity/1\n", " models:/p/1",
    "models:/propensity/1; rm -rf /", "runs:/0123/model", "models:/" + "m" * 65 + "/1", "models:/p/12345678901",
    None, 3, ["models:/p/1"],
])
def test_anything_else_is_refused_naming_the_field(uri):
    with pytest.raises(RegistryError, match=r"^deploy\.model_uri: .* give models:/<name>/<N>"):
        parse_version_uri(uri, "deploy.model_uri")


AT = "2026-12-05T01:00:00+00:00"


@pytest.mark.parametrize(("report", "summary"), [
    ({"model": "rt", "version": 5, "promoted": True, "slo_p99_ms": 50, "smoke": {"rows": 8, "max_abs_error": 0.0},
      "latency": {"p99_ms": 23.44}},
     f"{AT}: Triton rt version 5 promoted; smoke max abs error 0 over 8 rows; p99 23.4 ms (SLO 50 ms)"),
    ({"model": "rt", "version": 6, "promoted": False, "reason": "smoke test failed: max abs error 0.5",
      "smoke": {"rows": 8, "max_abs_error": 0.5}, "latency": None},
     f"{AT}: Triton rt version 6 rolled back: smoke test failed: max abs error 0.5; smoke max abs error 0.5 over "
     "8 rows"),
    ({"model": "rt", "version": 7, "promoted": False, "reason": None, "smoke": None},
     f"{AT}: Triton rt version 7 rolled back: no reason given"),
    ({"model": "rt", "version": 8, "promoted": False, "reason": "<b>${x}</b>\n'; --", "latency": {"p99_ms": "x"}},
     f"{AT}: Triton rt version 8 rolled back: <b>${{x}}</b>\n'; --"),
])
def test_deploy_tags_say_which_triton_version_serves_it_and_what_the_deploy_decided(report, summary):
    tags = deploy_tags(report, AT)
    assert tags == {"hybridflow.triton_model": "rt", "hybridflow.triton_version": str(report["version"]),
                    "hybridflow.deploy": summary}


def test_tag_values_are_clipped_at_mlflows_limit():
    tags = deploy_tags({"model": "rt", "version": 1, "reason": "r" * 9000}, AT)
    assert len(tags["hybridflow.deploy"]) == 5000 and tags["hybridflow.deploy"].endswith("...")
    assert scoring_tags("2026-12-04", 120000, "scheduled__x" * 1000)["hybridflow.last_scored_by"].endswith("...")
    assert scoring_tags("2026-12-04", 120000, "r") == {"hybridflow.last_scored_ds": "2026-12-04",
                                                       "hybridflow.last_scored_rows": "120000",
                                                       "hybridflow.last_scored_by": "r"}
