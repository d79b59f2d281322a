"""Every DAG's params guard the REST trigger: a bad value is refused (HTTP 400, naming the param and the nested
field) and no run is created. One row per class of bad value per kind of param: floats for ints, huge ints,
inf/-inf/NaN, out of range, wrong types, trailing newlines and stray whitespace, unknown object keys, nested
bad numbers. Confs are sent as raw JSON text, exactly as a client would write them (1e2, 1e400, NaN).

Requests to DAGs with a dry_run param carry dry_run=true, so a regression that accepted a value would start a
run that plans and does nothing; every run a request creates is failed and deleted. Good values create runs
only on those DAGs; on the others they are checked against the schemas the api-server serves."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from helpers.rest import call, local_api_when_up, remove_run

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DAGS = ("nightly_training", "workload_router", "oncall_rollback_model", "oncall_training_job", "release_model",
        "platform_healthcheck", "cluster_preflight", "reliability_probe", "deadline_probe", "slurm_reconciler",
        "cluster_utilization")
DRY_RUN = ("nightly_training", "workload_router")
# Valid values for params without a default, so that a refusal names the bad param; Slurm knows no such job.
REQUIRED = {"oncall_training_job": '"job_id": "999999999", "reason": "params api test"',
            # a run let through would release a version of no model: it fails at once, touching nothing
            "release_model": '"model_name": "params_api_no_such_model", "version": 1'}
HUGE = "1" + "0" * 29  # 30 digits: past the 64-bit ints the task runner can serialize
NOT_INT, NOT_NUM, NOT_STR, NOT_OBJ = ("is not of type 'integer'", "is not of type 'number'",
                                      "is not of type 'string'", "is not of type 'object'")
ABOVE, BELOW, NO_MATCH, NOT_ONE = "greater than the maximum", "less than the minimum", "does not match", "is not one of"
NAN = "nan should not be valid"
EXTRA = "Additional properties are not allowed"

# (dag_id, conf as JSON text, param, nested field or None, what the refusal says)
REFUSED = [
    # days: only YYYY-MM-DD or empty, nothing around it (the task refuses a day that is not in the calendar)
    ("cluster_utilization", '{"start_day": "2026-12-06; rm -rf /"}', "start_day", None, NO_MATCH),
    ("cluster_utilization", '{"start_day": "2026-12-6"}', "start_day", None, NO_MATCH),
    ("cluster_utilization", '{"start_day": "2026-12-06\\n"}', "start_day", None, NO_MATCH),
    ("cluster_utilization", '{"end_day": "../../etc"}', "end_day", None, NO_MATCH),
    ("cluster_utilization", '{"start_day": 20261206}', "start_day", None, NOT_STR),
    ("cluster_utilization", '{"end_day": null}', "end_day", None, NOT_STR),
    # integers: floats, huge, non-finite, out of range, wrong types
    ("nightly_training", '{"gpus_per_node": 1.0}', "gpus_per_node", None, NOT_INT),
    ("nightly_training", '{"epochs": 1e2}', "epochs", None, NOT_INT),
    ("nightly_training", f'{{"max_steps": {HUGE}}}', "max_steps", None, ABOVE),
    ("nightly_training", f'{{"nodes": -{HUGE}}}', "nodes", None, BELOW),
    ("nightly_training", '{"nodes": NaN}', "nodes", None, NOT_INT),
    ("nightly_training", '{"gpus_per_node": Infinity}', "gpus_per_node", None, NOT_INT),
    ("nightly_training", '{"epochs": -Infinity}', "epochs", None, NOT_INT),
    ("nightly_training", '{"train_window_days": 1e400}', "train_window_days", None, NOT_INT),
    ("nightly_training", '{"gpus_per_node": 99}', "gpus_per_node", None, "greater than the maximum of 8"),
    ("nightly_training", '{"epochs": 0}', "epochs", None, "less than the minimum of 1"),
    ("nightly_training", '{"nodes": 65}', "nodes", None, "greater than the maximum of 64"),
    ("nightly_training", '{"gpus_per_node": "8; rm -rf /"}', "gpus_per_node", None, NOT_INT),
    ("nightly_training", '{"nodes": "2 --wrap=id"}', "nodes", None, NOT_INT),
    ("nightly_training", '{"nodes": null}', "nodes", None, NOT_INT),
    ("nightly_training", '{"max_steps": true}', "max_steps", None, NOT_INT),
    ("oncall_rollback_model", f'{{"version": {HUGE}}}', "version", None, ABOVE),
    ("oncall_rollback_model", '{"version": 3.0}', "version", None, NOT_INT),
    ("oncall_rollback_model", '{"version": NaN}', "version", None, NOT_INT),
    ("oncall_rollback_model", '{"version": -1}', "version", None, BELOW),
    ("oncall_rollback_model", '{"version": "3"}', "version", None, NOT_INT),
    ("cluster_preflight", '{"gpus_per_node": 2.0}', "gpus_per_node", None, NOT_INT),
    ("cluster_preflight", f'{{"nodes": {HUGE}}}', "nodes", None, ABOVE),
    ("reliability_probe", '{"sleep_s": 1e2}', "sleep_s", None, NOT_INT),
    ("deadline_probe", '{"sleep_s": 601}', "sleep_s", None, ABOVE),
    ("deadline_probe", '{"sleep_s": "60"}', "sleep_s", None, NOT_INT),
    ("reliability_probe", f'{{"sleep_s": {HUGE}}}', "sleep_s", None, ABOVE),
    # numbers (the router's measured profile): non-finite, huge, negative, wrong types
    ("workload_router", '{"profile": {"gpu_speedup": 1e400}}', "profile", "gpu_speedup", ABOVE),
    ("workload_router", '{"profile": {"cpu_p99_ms": -Infinity}}', "profile", "cpu_p99_ms", BELOW),
    ("workload_router", '{"profile": {"arithmetic_intensity_flops_per_byte": NaN}}', "profile",
     "arithmetic_intensity_flops_per_byte", NAN),
    ("workload_router", f'{{"profile": {{"batch_rows": {HUGE}}}}}', "profile", "batch_rows", ABOVE),
    ("workload_router", '{"profile": {"cpu_p99_ms": -1}}', "profile", "cpu_p99_ms", BELOW),
    ("workload_router", '{"profile": {"gpu_speedup": "5"}}', "profile", "gpu_speedup", NOT_NUM),
    ("workload_router", '{"profile": {"gpu_speedup": true}}', "profile", "gpu_speedup", NOT_NUM),
    # objects: unknown keys, wrong types, nested huge/float/non-finite numbers, nested bad strings
    ("workload_router", '{"profile": {"bogus": 1}}', "profile", "bogus", EXTRA),
    ("workload_router", '{"profile": []}', "profile", None, NOT_OBJ),
    ("workload_router", '{"config": {"cmd": "id"}}', "config", "cmd", EXTRA),
    ("workload_router", '{"config": "rows=5"}', "config", None, NOT_OBJ),
    ("workload_router", f'{{"config": {{"rows": {HUGE}}}}}', "config", "rows", ABOVE),
    ("workload_router", '{"config": {"batch": 64.0}}', "config", "batch", NOT_INT),
    ("workload_router", '{"config": {"lookback_days": 1e400}}', "config", "lookback_days", NOT_INT),
    ("workload_router", '{"config": {"rows": NaN}}', "config", "rows", NOT_INT),
    ("workload_router", '{"config": {"batch": 0}}', "config", "batch", BELOW),
    ("workload_router", '{"config": {"ds": {"x": 1}}}', "config", "ds", NOT_STR),
    ("workload_router", '{"config": {"ds": "2026-02-30"}}', "config", "ds", "is not a 'date'"),
    # Refused by the pattern, or first by the 'date' format where Python's date.fromisoformat is strict (3.11.2)
    ("workload_router", '{"config": {"ds": "2026-01-01\\n"}}', "config", "ds", "'2026-01-01\\n' "),
    ("workload_router", '{"config": {"hidden_sizes": "128,64\\n"}}', "config", "hidden_sizes", NO_MATCH),
    ("workload_router", '{"config": {"hidden_sizes": "128, 64"}}', "config", "hidden_sizes", NO_MATCH),
    # strings with a pattern: trailing newline, whitespace, too long, wrong types
    ("oncall_rollback_model", '{"model_name": "x\\n"}', "model_name", None, NO_MATCH),
    ("oncall_rollback_model", '{"model_name": " x"}', "model_name", None, NO_MATCH),
    ("oncall_rollback_model", json.dumps({"model_name": "a" * 129}), "model_name", None, NO_MATCH),
    ("oncall_rollback_model", '{"model_name": 5}', "model_name", None, NOT_STR),
    ("release_model", '{"version": 0}', "version", None, BELOW),
    ("release_model", '{"version": 2.0}', "version", None, NOT_INT),
    ("release_model", '{"version": "2"}', "version", None, NOT_INT),
    ("release_model", f'{{"version": {HUGE}}}', "version", None, ABOVE),
    ("release_model", '{"version": null}', "version", None, NOT_INT),
    ("release_model", '{"model_name": "../../etc"}', "model_name", None, NO_MATCH),
    ("release_model", '{"model_name": "m; rm -rf /"}', "model_name", None, NO_MATCH),
    ("release_model", '{"approval": "yes"}', "approval", None, NOT_ONE),
    ("release_model", '{"approval": "ask\\n"}', "approval", None, NOT_ONE),
    ("release_model", '{"approval": true}', "approval", None, NOT_ONE),
    ("oncall_training_job", '{"job_id": "4242\\n"}', "job_id", None, NO_MATCH),
    ("oncall_training_job", '{"job_id": " 4242"}', "job_id", None, NO_MATCH),
    ("oncall_training_job", json.dumps({"job_id": "1" * 30}), "job_id", None, NO_MATCH),
    ("oncall_training_job", '{"job_id": 4242}', "job_id", None, NOT_STR),
    ("oncall_training_job", '{"reason": "x\\n"}', "reason", None, NO_MATCH),
    ("oncall_training_job", '{"reason": "   "}', "reason", None, NO_MATCH),
    ("oncall_training_job", '{"reason": "ok\\u0000"}', "reason", None, NO_MATCH),
    ("oncall_training_job", '{"reason": ["x"]}', "reason", None, NOT_STR),
    ("platform_healthcheck", '{"partition": "gpu-training\\n"}', "partition", None, NO_MATCH),
    ("platform_healthcheck", '{"partition": "gpu-training "}', "partition", None, NO_MATCH),
    ("cluster_preflight", '{"hidden_sizes": "128,64\\n"}', "hidden_sizes", None, NO_MATCH),
    ("cluster_preflight", '{"hidden_sizes": " 128,64"}', "hidden_sizes", None, NO_MATCH),
    # enums and booleans
    ("nightly_training", '{"train": "auto\\n"}', "train", None, NOT_ONE),
    ("nightly_training", '{"model_preset": "huge"}', "model_preset", None, NOT_ONE),
    ("nightly_training", '{"device": "tpu"}', "device", None, NOT_ONE),
    ("nightly_training", '{"device": "GPU"}', "device", None, NOT_ONE),
    ("workload_router", '{"workload_type": "model_training\\n"}', "workload_type", None, NOT_ONE),
    ("platform_healthcheck", '{"spark_conn_id": " spark_default"}', "spark_conn_id", None, NOT_ONE),
    ("platform_healthcheck", '{"run_spark": "yes"}', "run_spark", None, "is not of type 'boolean'"),
    ("slurm_reconciler", '{"dry_run": "false"}', "dry_run", None, "is not of type 'boolean'"),
    ("slurm_reconciler", '{"grace_s": -1}', "grace_s", None, BELOW),
    ("slurm_reconciler", f'{{"grace_s": {HUGE}}}', "grace_s", None, ABOVE),
    ("slurm_reconciler", '{"grace_s": 300.0}', "grace_s", None, NOT_INT),
    ("slurm_reconciler", '{"dag_ids": ["nightly_training\\n"]}', "dag_ids", None, NO_MATCH),
    ("slurm_reconciler", '{"dag_ids": ["../x y"]}', "dag_ids", None, NO_MATCH),
    ("slurm_reconciler", '{"dag_ids": "nightly_training"}', "dag_ids", None, "is not of type 'array'"),
]

# Good values of every kind: each creates a (dry) run on the DAGs with dry_run ...
ACCEPTED_RUNS = [
    ("nightly_training", '{"gpus_per_node": 2, "epochs": 3, "nodes": 1, "max_steps": 1000000, "model_preset": "tiny"}'),
    ("nightly_training", '{"device": "cpu", "model_preset": "large"}'),
    ("workload_router", '{"workload_type": "model_training", "config": {"hidden_sizes": "256,128", "batch": 64}, '
                        '"profile": {"gpu_speedup": 3.5, "batch_rows": 1e6, "cpu_p99_ms": 0}}'),
    ("workload_router", '{"workload_type": "feature_engineering", '
                        '"config": {"ds": "2024-02-29", "lookback_days": 90, "rows": 10000000}}'),
]
# ... and passes the schemas the api-server serves on the others (a run there would do real work).
ACCEPTED_BY_SCHEMA = [
    ("oncall_rollback_model", {"model_name": "hybridflow-model_v1.2", "version": 2147483647}),
    ("oncall_rollback_model", {"version": 0}),
    ("release_model", {"model_name": "hybridflow-model_v1.2", "version": 2147483647, "approval": "auto"}),
    ("release_model", {"version": 1}),
    ("oncall_training_job", {"job_id": "4242_3", "reason": "gpu-node-01 hangs; requeue (ticket #12)"}),
    ("oncall_training_job", {"job_id": "4294967295", "reason": "x"}),
    ("platform_healthcheck", {"partition": "cpu", "run_spark": False, "spark_conn_id": "spark_standalone"}),
    ("cluster_preflight", {"nodes": 64, "gpus_per_node": 8, "hidden_sizes": "4096,4096,2048,1024"}),
    ("reliability_probe", {"sleep_s": 600}),
    ("deadline_probe", {"sleep_s": 1}),
    ("slurm_reconciler", {"dry_run": True, "grace_s": 0, "dag_ids": ["nightly_training", "workload_router"]}),
    ("cluster_utilization", {"start_day": "2026-11-01", "end_day": "2026-12-01"}),
    ("cluster_utilization", {"start_day": "", "end_day": ""}),
]


@pytest.fixture(scope="module")
def api(stack):
    return local_api_when_up()


@pytest.fixture(scope="module")
def served(api) -> dict[str, dict]:
    """Each DAG's params as the api-server serves them, once the DAG processor has parsed the strict schemas."""
    deadline = time.monotonic() + 180
    while True:
        params = {dag_id: api.get(f"/api/v2/dags/{dag_id}/details")["params"] for dag_id in DAGS}
        if all(p["schema"].get("$schema") == DRAFT4 for dag in params.values() for p in dag.values()):
            return params
        assert time.monotonic() < deadline, "the served param schemas are not the strict ones (DAGs not parsed?)"
        time.sleep(3)


def trigger(api, dag_id: str, conf: str) -> tuple[str, int, dict]:
    """POSTs a run with ``conf`` (JSON text) after the DAG's required values and dry_run=true; the row's own
    keys come last, so they win."""
    extras = [REQUIRED[dag_id]] if dag_id in REQUIRED else []
    extras += ['"dry_run": true'] if dag_id in DRY_RUN else []
    if extras:
        conf = "{" + ", ".join(extras) + ", " + conf.removeprefix("{")
    run_id = f"params_api_test__{uuid.uuid4().hex[:12]}"
    status, body = call(api, "POST", f"/api/v2/dags/{dag_id}/dagRuns",
                        f'{{"dag_run_id": "{run_id}", "logical_date": null, "conf": {conf}}}')
    return run_id, status, body


@pytest.mark.parametrize(("dag_id", "conf", "param", "field", "why"), REFUSED,
                         ids=[f"{d}-{c[:40]}" for d, c, *_ in REFUSED])
def test_trigger_with_an_invalid_param_is_refused(api, served, dag_id, conf, param, field, why):
    run_id, status, body = trigger(api, dag_id, conf)
    try:
        assert status == 400, f"HTTP {status}: {body}"
        detail = str(body.get("detail"))
        assert f"Invalid input for param {param}:" in detail and why in detail, detail
        assert field is None or f"'{field}'" in detail, f"the refusal does not name {field}: {detail}"
        assert call(api, "GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")[0] == 404, "the refused run exists"
    finally:
        if status < 300:
            remove_run(api, dag_id, run_id)


@pytest.mark.parametrize(("dag_id", "conf"), ACCEPTED_RUNS, ids=[f"{d}-{c[:40]}" for d, c in ACCEPTED_RUNS])
def test_trigger_with_valid_params_creates_a_dry_run(api, served, dag_id, conf):
    run_id, status, body = trigger(api, dag_id, conf)
    try:
        assert status < 300, f"HTTP {status}: {body}"
        assert body["conf"]["dry_run"] is True and body["conf"] == {**body["conf"], **json.loads(conf)}
    finally:
        if status < 300:
            remove_run(api, dag_id, run_id)


def test_served_schemas_accept_defaults_and_good_values(served):
    """The api-server's own check (its SerializedParamsDict) on the schemas it serves: every default still
    resolves, and good values of every kind pass."""
    from airflow.serialization.definitions.param import SerializedParam, SerializedParamsDict

    unresolved = [f"{d}.{n}" for d, params in served.items() for n, p in params.items()
                  if p["value"] is None and n not in ("job_id", "reason", "version")]
    assert unresolved == [], "defaults the served schema refuses"
    for dag_id, conf in ACCEPTED_BY_SCHEMA:
        params = SerializedParamsDict({name: SerializedParam(p["value"], **p["schema"])
                                       for name, p in served[dag_id].items()})
        params.deep_merge(conf).validate()
