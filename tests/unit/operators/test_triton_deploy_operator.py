"""The deploy's pure parts: export parsing, version choices, smoke comparison, latency figures, the serving
config section, the local repository's atomic publish and the readiness trigger's serialization."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from hybridflow.config import ReleaseConfig, load_pipeline_config
from hybridflow.exceptions import ConfigError, TritonError
from hybridflow.hooks.model_repository import LocalModelRepository
from hybridflow.triggers.triton import TritonModelReadyTrigger, TritonReleaseStepTrigger
from hybridflow.utils.latency import percentile, summarize
from hybridflow.utils.triton import (
    ModelConfigSpec,
    Repository,
    SmokeSet,
    VersionRecord,
    VersionStatus,
    find_published,
    loaded_versions,
    model_status_url,
    next_version,
    parse_signature,
    parse_smoke,
    read_export,
    render_model_config,
    rollback_target,
    serving_version,
    version_numbers,
    versions_of,
)

REPO = Path(__file__).resolve().parents[3]


def signature(n: int = 3, **changes) -> dict:
    data = {"feature_columns": [f"f{i}" for i in range(n)], "n_features": n,
            "inputs": [{"name": "INPUT__0", "dtype": "float32", "shape": [-1, n]}],
            "outputs": [{"name": "OUTPUT__0", "dtype": "float32", "shape": [-1, 1]}]}
    data.update(changes)
    return data


def smoke(n: int = 3, **changes) -> dict:
    data = {"input_name": "INPUT__0", "output_name": "OUTPUT__0", "atol": 1e-5,
            "inputs": [[0.0] * n, [1.0] * n], "outputs": [[0.25], [0.75]]}
    data.update(changes)
    return data


def record(version: int, status: VersionStatus = VersionStatus.PROMOTED, sha: str = "") -> VersionRecord:
    return VersionRecord(version=version, sha256=sha or f"sha{version}", n_features=3, source="x",
                         published_at="t", status=status)


def test_triton_signature_of_the_export_job_parses():
    assert parse_signature(signature(5)).n_features == 5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_features": 0}, "n_features is 0"),
        ({"feature_columns": ["a"]}, "feature_columns has 1 names but n_features is 3"),
        ({"inputs": [{"name": "input", "shape": [-1, 3]}]}, "inputs[0].name is 'input'"),
        ({"outputs": []}, "outputs must list exactly one tensor"),
        ({"inputs": [{"name": "INPUT__0", "dtype": "float64", "shape": [-1, 3]}]}, "Triton serves float32"),
        ({"inputs": [{"name": "INPUT__0", "shape": [-1, 4]}]}, "inputs[0].shape is [-1, 4]; expected [-1, 3]"),
    ],
)
def test_triton_signature_mistakes_name_the_field(changes, message):
    with pytest.raises(ConfigError) as err:
        parse_signature(signature(**changes), "export/signature.json")
    assert "export/signature.json" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"atol": -1}, "atol is -1"),
        ({"input_name": "x"}, "input_name is 'x'"),
        ({"inputs": []}, "inputs must be a non-empty list"),
        ({"outputs": [[0.1]]}, "outputs must have one row per input row (2)"),
        ({"inputs": [[0.0, 1.0], [1.0] * 3]}, "inputs[0] has 2 values; the signature says n_features=3"),
        ({"outputs": [[0.1, 0.2], [0.3]]}, "outputs[0] must be one probability"),
        ({"outputs": [["a"], [0.3]]}, "a value is not a number"),
    ],
)
def test_triton_smoke_mistakes_name_the_field(changes, message):
    with pytest.raises(ConfigError, match="smoke.json") as err:
        parse_smoke(smoke(**changes), 3)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "actual, error, passed",
    [
        ([[0.25], [0.75]], 0.0, True),
        ([[0.25], [0.750009]], 9e-6, True),
        ([[0.25], [0.76]], 0.01, False),
        ([[0.25]], float("inf"), False),  # a row missing
        ([], float("inf"), False),  # the request failed
        ([[float("nan")], [0.75]], float("inf"), False),
    ],
)
def test_triton_smoke_check_compares_within_atol(actual, error, passed):
    result = parse_smoke(smoke(), 3).check(actual)
    assert result.rows == 2 and result.atol == 1e-5
    assert result.max_abs_error == pytest.approx(error, abs=1e-9)
    assert result.passed is passed
    assert result.to_dict()["max_abs_error"] == (None if error == float("inf") else result.max_abs_error)


def test_triton_version_numbers_follow_tritons_rule():
    assert version_numbers(["3", "config.pbtxt", "10", "01", "0", "x1", ".staging"]) == [3, 10]
    assert next_version([]) == 1 and next_version([1, 4, 2]) == 5


def test_triton_version_choices_of_deploy_and_rollback():
    records = {1: record(1), 2: record(2), 3: record(3, VersionStatus.ROLLED_BACK, sha="abc"),
               4: record(4, VersionStatus.PUBLISHED)}
    assert find_published(records, "abc") == 3 and find_published(records, "new") is None
    assert serving_version([], records) is None
    assert serving_version([2, 4], records) == 2  # mid-deploy: the promoted one serves
    assert serving_version([4], records) == 4
    assert rollback_target(2, records) == 1
    assert rollback_target(1, records) is None
    assert rollback_target(None, records) == 2
    assert loaded_versions(None, 1) == (1,) and loaded_versions(2, 5) == (2, 5) and loaded_versions(2, 2) == (2,)


def test_triton_config_keeps_the_previous_version_loaded_beside_the_new_one():
    text = render_model_config(ModelConfigSpec(name="m", n_features=3, versions=loaded_versions(2, 5)))
    assert "version_policy: { specific: { versions: [ 2, 5 ] } }" in text


def test_triton_version_record_round_trips():
    original = record(3).with_status(VersionStatus.ROLLED_BACK, "2026-01-01", "smoke failed")
    assert VersionRecord.from_json(original.to_json()) == original
    assert json.loads(original.to_json())["status"] == "rolled_back"


@pytest.mark.parametrize(
    "uri, scheme, location, prefix",
    [("/srv/models/", "local", "/srv/models", ""), ("s3://bucket/a/b/", "s3", "bucket", "a/b"),
     ("s3://bucket", "s3", "bucket", "")],
)
def test_triton_repository_uris(uri, scheme, location, prefix):
    parsed = Repository.parse(uri)
    assert (parsed.scheme, parsed.location, parsed.prefix) == (scheme, location, prefix)


@pytest.mark.parametrize("uri, message", [("", "repository is empty"), ("models", "absolute path"),
                                          ("gs://b/p", "s3://bucket/prefix"), ("s3:///p", "bucket is missing")])
def test_triton_repository_uri_mistakes(uri, message):
    with pytest.raises(ConfigError, match=message):
        Repository.parse(uri)


def test_triton_model_status_url_quotes_the_name():
    assert model_status_url("http://h:8000/", "m.v", 3) == "http://h:8000/v2/models/m.v/versions/3"
    assert model_status_url("http://h:8000", "m", None) == "http://h:8000/v2/models/m"


def test_triton_versions_of_an_index_keeps_one_model():
    index = [{"name": "m", "version": "1", "state": "READY"}, {"name": "m", "version": "2", "state": "UNAVAILABLE",
             "reason": "boom"}, {"name": "other", "version": "1", "state": "READY"}, {"name": "m"}]
    assert versions_of(index, "m") == {1: {"state": "READY", "reason": ""}, 2: {"state": "UNAVAILABLE",
                                                                                "reason": "boom"}}


def test_latency_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted in, observed out
    assert percentile([float(v) for v in range(1, 11)], 10) == 1
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_summary_leaves_the_warm_up_out_and_bounds_the_p99():
    summary = summarize([0.5] * 20 + [0.001] * 370 + [0.060] * 10, wall_s=2, concurrency=4, warmup=20)
    assert (summary.requests, summary.measured, summary.warmup, summary.p50_ms, summary.p99_ms) == \
        (400, 380, 20, 1.0, 60.0)
    assert (summary.p99_low_ms, summary.p99_high_ms) == (60.0, 60.0)
    assert summary.explain() == "p99 60.00 ms of 380 requests after 20 warm-up; 95% bounds [60.00, 60.00] ms"
    few = summarize([0.001] * 98 + [0.060, 0.070], wall_s=0.5, concurrency=4)
    assert (few.requests, few.p50_ms, few.p99_ms, few.throughput_rps) == (100, 1.0, 60.0, 200.0)
    assert (few.p99_low_ms, few.p99_high_ms) == (1.0, None)  # 100 samples bound no p99 from above
    assert summarize([], wall_s=1, concurrency=1, failed=3).p99_ms is None


def write_export(directory: Path, n: int = 3, **smoke_changes) -> Path:
    directory.mkdir()
    (directory / "model.pt").write_bytes(b"weights")
    (directory / "signature.json").write_text(json.dumps(signature(n)))
    (directory / "smoke.json").write_text(json.dumps(smoke(n, **smoke_changes)))
    return directory


def test_triton_read_export_hashes_the_model_and_lists_the_version_files(tmp_path):
    bundle = read_export(write_export(tmp_path / "export"))
    assert bundle.sha256 == hashlib.sha256(b"weights").hexdigest()
    assert sorted(bundle.version_files()) == ["model.pt", "model.py", "signature.json", "smoke.json"]
    assert isinstance(bundle.smoke, SmokeSet) and bundle.signature.n_features == 3


def test_triton_read_export_names_what_is_missing_or_broken(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        read_export(tmp_path / "nowhere")
    export = write_export(tmp_path / "export")
    (export / "smoke.json").unlink()
    with pytest.raises(ConfigError, match="smoke.json missing; re-run the export step"):
        read_export(export)
    (export / "smoke.json").write_text("{not json")
    with pytest.raises(ConfigError, match="smoke.json: not valid JSON"):
        read_export(export)


def test_triton_local_publish_is_one_rename_and_never_overwrites(tmp_path):
    repo = LocalModelRepository(Repository.parse(str(tmp_path / "repo")))
    files = {"model.pt": b"weights", "model.py": b"code"}
    repo.publish_version("m", 1, files, record(1, VersionStatus.PUBLISHED))
    assert sorted(p.name for p in (tmp_path / "repo" / "m" / "1").iterdir()) == ["hybridflow.json", "model.pt",
                                                                                   "model.py"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["m"]  # no staging left for the index
    assert repo.versions("m") == [1] and repo.records("m")[1].status is VersionStatus.PUBLISHED
    with pytest.raises(TritonError, match="cannot publish version 1 of m"):
        repo.publish_version("m", 1, {"model.pt": b"other"}, record(1))
    assert (tmp_path / "repo" / "m" / "1" / "model.pt").read_bytes() == b"weights"
    assert repo.write_config("m", "a") is True and repo.write_config("m", "a") is False
    assert repo.read_config("m") == "a"
    repo.remove_model("m")
    assert repo.versions("m") == []


def test_triton_ready_trigger_serializes_everything_it_needs():
    trigger = TritonModelReadyTrigger("triton_default", "m", version=3, timeout_s=60, load=False,
                                      poll_interval_s=2, started_at=100.0, carry={"previous_version": 2})
    path, kwargs = trigger.serialize()
    assert path == "hybridflow.triggers.triton.TritonModelReadyTrigger"
    assert kwargs == {"triton_conn_id": "triton_default", "model_name": "m", "version": 3, "timeout_s": 60,
                      "load": False, "poll_interval_s": 2, "started_at": 100.0, "carry": {"previous_version": 2}}
    assert TritonModelReadyTrigger(**kwargs).serialize() == (path, kwargs)


def test_triton_release_step_trigger_serializes_everything_it_needs():
    trigger = TritonReleaseStepTrigger("triton_default", "m", generation=4, thresholds={"min_requests": 50},
                                       min_window_s=10, timeout_s=None, poll_interval_s=1, started_at=100.0,
                                       carry={"step": 1, "report": {"release": {"steps": []}}})
    path, kwargs = trigger.serialize()
    assert path == "hybridflow.triggers.triton.TritonReleaseStepTrigger"
    assert kwargs == {"triton_conn_id": "triton_default", "model_name": "m", "generation": 4,
                      "thresholds": {"min_requests": 50}, "min_window_s": 10, "timeout_s": None,
                      "poll_interval_s": 1, "started_at": 100.0,
                      "carry": {"step": 1, "report": {"release": {"steps": []}}}}
    assert TritonReleaseStepTrigger(**kwargs).serialize() == (path, kwargs)


@pytest.mark.parametrize("release, steps", [
    (ReleaseConfig(), [("shadow", 0), ("canary", 10), ("canary", 50)]),
    (ReleaseConfig(shadow_s=0), [("canary", 10), ("canary", 50)]),
    (ReleaseConfig(shadow_s=30, canary_steps=(100,)), [("shadow", 0)]),
    (ReleaseConfig(shadow_s=0, canary_steps=(100,)), []),  # nothing to judge: promoted after the gates
    (ReleaseConfig(canary_steps=(1, 5, 25, 100)), [("shadow", 0), ("canary", 1), ("canary", 5), ("canary", 25)]),
])
def test_a_progressive_release_judges_shadow_then_each_canary_share_below_100(release, steps):
    from hybridflow.operators.triton import TritonDeployOperator

    operator = TritonDeployOperator(task_id="deploy", export_dir="/x", model_name="m", repository="/srv/models",
                                    release=release)
    assert operator.release_steps() == steps


GOOD = yaml.safe_load((REPO / "include/config/pipeline.yaml").read_text())


def test_serving_config_checked_in_section_loads(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_SLO_P99_MS", raising=False)  # the local stack raises it for its 2 shared cores
    serving = load_pipeline_config().serving
    assert serving.slo_p99_ms == 50.0 and serving.backend == "python" and serving.model_name == "propensity"
    assert serving.repository.endswith("/model-repository")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("backend", "onnx", "pipeline.serving.backend: 'onnx'; choose python or pytorch_libtorch"),
        ("model_name", "bad name", "pipeline.serving.model_name: 'bad name'"),
        ("repository", "relative/dir", "pipeline.serving.repository: repository 'relative/dir'"),
        ("slo_p99_ms", 0, "pipeline.serving.slo_p99_ms: 0.0; expected a positive number"),
        ("gate_concurrency", 0, "pipeline.serving.gate_concurrency: 0; expected a positive integer"),
        ("max_queue_delay_us", -1, "pipeline.serving.max_queue_delay_us: -1; expected >= 0"),
        ("instance_count", "two", "pipeline.serving.instance_count: expected int, got str 'two'"),
        ("gate_seconds", 5, "pipeline.serving: unknown key(s) gate_seconds"),
        ("gate_requests", 200, "pipeline.serving.gate_requests: 200 with gate_warmup_requests 20; the gate's "
                               "percentiles need 368 measured requests for their 95% bounds: give gate_requests >= "
                               "388"),
        ("gate_warmup_requests", 150, "gate_requests: 400 with gate_warmup_requests 150;"),
        ("gate_warmup_requests", -1, "gate_requests: 400 with gate_warmup_requests -1;"),
        ("gate_warmup_requests", "20", "pipeline.serving.gate_warmup_requests: expected int, got str '20'"),
    ],
)
def test_serving_config_mistakes_name_the_key(tmp_path, key, value, message):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["serving"][key] = value
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(path)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"slo_p99_ms": 0}, "slo_p99_ms is 0; give the p99 budget in milliseconds"),
        ({"concurrency": 0}, "concurrency is 0; give a positive integer"),
        ({"gate_warmup_requests": 400}, "gate_warmup_requests is 400; give a whole number from 0 to gate_requests"),
        ({"gate_warmup_requests": -1}, "gate_warmup_requests is -1; give a whole number from 0"),
        ({"gate_warmup_requests": 2.5}, "gate_warmup_requests is 2.5; give a whole number"),
        ({"gate_warmup_requests": True}, "gate_warmup_requests is True; give a whole number"),
        ({"model_name": "../up"}, "model_name '../up'"),
        ({"repository": "relative"}, "a local repository must be an absolute path"),
        ({"readiness_timeout_s": 0}, "readiness_timeout_s is 0"),
        ({"approval": "maybe"}, "approval is 'maybe'; choose auto or ask"),
        ({"approval": ""}, "approval is ''; choose auto or ask"),
        ({"version": 2}, "export_dir '/x', version 2: give one of them"),
        ({"export_dir": "", "version": 0}, "export_dir '', version 0: give one of them"),
        ({"export_dir": "", "version": "2; rm -rf /"}, "version '2; rm -rf /': give a published version number"),
        ({"export_dir": "", "version": "-1"}, "version '-1': give a published version number"),
        ({"export_dir": "", "version": "1.5"}, "version '1.5': give a published version number"),
    ],
)
def test_triton_deploy_operator_refuses_bad_arguments_before_any_call(kwargs, message):
    from hybridflow.operators.triton import TritonDeployOperator

    operator = TritonDeployOperator(task_id="deploy", **{"export_dir": "/x", "model_name": "m",
                                                         "repository": "/srv/models", **kwargs})
    with pytest.raises(ConfigError, match=re.escape(message)):
        operator.validate()


def test_triton_model_status_link_points_at_the_deployed_version():
    from hybridflow.operators.triton import TritonDeployOperator, TritonModelStatusLink

    operator = TritonDeployOperator(task_id="deploy", export_dir="/x", model_name="m", repository="/srv/models")
    assert TritonModelStatusLink().get_link(operator, ti_key=None) == ""
    operator.status_url = "http://h:8000/v2/models/m/versions/2"
    assert TritonModelStatusLink().get_link(operator, ti_key=None) == operator.status_url
    assert TritonModelStatusLink.name == "Model status"


@pytest.mark.parametrize(
    "error, unavailable",
    [
        ("unavailable", True),  # gRPC UNAVAILABLE: refused, reset, "Server exiting"
        (ConnectionRefusedError(111, "Connection refused"), True),
        ("closed", True),  # geventhttpclient's closed connection is an http.client.HTTPException
        ("not_found", False),  # the model's own errors say nothing about the server
        ("invalid", False),
        (TimeoutError("timed out"), False),  # a hung server did not go away
    ],
)
def test_triton_hook_tells_a_server_that_went_away_from_a_model_error(error, unavailable):
    from types import SimpleNamespace

    from geventhttpclient.response import HTTPConnectionClosed
    from hybridflow.hooks.triton import ServerUnavailable, TritonHook
    from tritonclient.utils import InferenceServerException

    errors = {
        "unavailable": InferenceServerException("Server exiting", status="StatusCode.UNAVAILABLE"),
        "closed": HTTPConnectionClosed("connection closed."),
        "not_found": InferenceServerException("Request for unknown model", status="StatusCode.NOT_FOUND"),
        "invalid": InferenceServerException("load failed for model 'm'", status="StatusCode.INVALID_ARGUMENT"),
    }

    def call(**_):
        raise errors.get(error, error) if isinstance(error, str) else error

    hook = TritonHook("triton_unit")
    hook.__dict__["connection"] = SimpleNamespace(host="h", port=8000, password=None, extra_dejson={})
    with pytest.raises(TritonError) as raised:
        hook._call("inference on m", call)
    assert isinstance(raised.value, ServerUnavailable) is unavailable
