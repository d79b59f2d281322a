"""The pages the suite adds to the running Airflow api-server (plugins/hybridflow_ui.py): behind Airflow's login,
run reports served only for DAGs Airflow knows and only from that DAG's folder of the report store, a Slurm job's
record and log tail. Hostile requests get a 4xx, never a file or a 500, and leave the api-server healthy."""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from airflow_api import local_api
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.utils.slurm import SlurmJobSpec, render_sbatch_script


def fetch(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


@pytest.fixture(scope="module")
def api(stack):
    return local_api()


@pytest.fixture
def report(api, stack):
    """A report file of nightly_training in the real report store: (storage root, path below the DAG's folder)."""
    storage = Path(stack["HYBRIDFLOW_STORAGE_ROOT"])
    store = storage / "reports" / "nightly_training" / f"test-{uuid.uuid4().hex[:6]}"
    store.mkdir(parents=True)
    (store / "report.html").write_text("<h1>figures</h1>")
    yield storage, f"{store.name}/report.html"
    shutil.rmtree(store)


def assert_still_healthy(api):
    status, body = fetch(f"{api.base_url}/api/v2/monitor/health")
    assert status == 200 and '"metadatabase"' in body, body


def test_ui_pages_need_a_login(api):
    status, _ = fetch(f"{api.base_url}/hybridflow/slurm/jobs/1")
    assert status == 401


@pytest.mark.parametrize("page", ["docs", "redoc", "openapi.json", "docs/oauth2-redirect"])
def test_ui_api_docs_and_schema_are_not_served_without_a_login(api, page):
    status, body = fetch(f"{api.base_url}/hybridflow/{page}")
    assert status in (401, 403, 404) and "openapi" not in body.lower() and "/reports/" not in body, (status, body)


def test_ui_report_is_served_from_the_report_store_only(api, report):
    _, relative = report
    status, body = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/{relative}", api.token)
    assert (status, body) == (200, "<h1>figures</h1>")
    name = relative.split("/")[0]
    for hostile in ("..%2F..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", f"{name}/..%2F..%2F..%2Fmodels"):
        status, _ = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/{hostile}", api.token)
        assert status == 404, hostile


def test_ui_report_dag_id_must_be_a_dag_airflow_knows(api, report):
    """`..` moved the base to the storage root, `.` served any DAG's report under an access check on `.`, a folder
    in the store with no DAG behind it was served to anyone allowed to read a DAG of that name."""
    storage, relative = report
    unknown = storage / "reports" / f"no_such_dag_{uuid.uuid4().hex[:6]}"
    unknown.mkdir()
    (unknown / "report.html").write_text("<h1>orphan</h1>")
    try:
        hostile = [
            "%2e%2e/models/propensity/registry.json", "%2e%2e/alerts/alerts.jsonl",
            "%2e%2e/models/propensity/v1/model.pt", "%2E%2E/models/propensity/registry.json",
            ".%2e/models/propensity/registry.json", "%2e%2e%2fmodels/propensity/registry.json",
            "%2e/nightly_training/" + relative, "%2e%2e/reports/nightly_training/" + relative,
            "%252e%252e/models/propensity/registry.json", "nightly_training%00/" + relative,
            "nightly_training%0D/" + relative, "nightly_training%20/" + relative, "%5Cnightly_training/" + relative,
            "NIGHTLY_TRAINING/" + relative, "x" * 251 + "/report.html", f"{unknown.name}/report.html",
        ]
        for path in hostile:
            status, body = fetch(f"{api.base_url}/hybridflow/reports/{path}", api.token)
            assert status in (400, 404) and "champion" not in body and "orphan" not in body, (path, status, body)
        status, _ = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/{relative}", api.token)
        assert status == 200
        assert_still_healthy(api)
    finally:
        shutil.rmtree(unknown)


# Every class of hostile name below the DAG's folder, percent-encoded as a client sends it.
HOSTILE_REPORT_PATHS = [
    "{run}/report.html%00.png", "{run}/report.html%00", "%00", "{run}/report%01.html", "{run}/report.html%1F",
    "{run}/report.html%7F", "{run}/report.html%C2%85", "{run}/report%E2%80%AE.html", "{run}/report.html%0D",
    "{run}/report.html%09", "{run}/report.html%0A", "%5C..%5C..%5Cmodels%5Cpropensity%5Cregistry.json",
    "{run}%5Creport.html", "..%2F..%2Fmodels%2Fpropensity%2Fregistry.json", "{run}%2F..%2F{run}%2Freport.html",
    "%2Fetc%2Fpasswd", "%2F%2Fetc%2Fpasswd", "{run}//report.html", "{run}/./report.html", "{run}/report.html/",
    "%252e%252e%252Fmodels", "{run}%252Freport.html", "n" * 256, "{run}/" + "n" * 300 + ".html",
    "/".join(["n" * 200] * 6), "",
]


@pytest.mark.parametrize("path", HOSTILE_REPORT_PATHS, ids=lambda path: path[:40])
def test_ui_report_path_refuses_control_characters_separators_and_overlong_names(api, report, path):
    _, relative = report
    status, body = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/"
                         + path.format(run=relative.split("/")[0]), api.token)
    assert status in (400, 404) and "figures" not in body, (status, body)
    assert_still_healthy(api)


def test_ui_report_refuses_symlinks_out_of_the_dag_folder(api, report):
    """A symlink in the store, or a DAG's folder that is one, never serves what it points at."""
    storage, relative = report
    run = storage / "reports" / "nightly_training" / relative.split("/")[0]
    outside = storage / "tmp" / f"test-ui-{uuid.uuid4().hex[:6]}"
    outside.mkdir(parents=True)
    secret = f"not-for-the-ui-{uuid.uuid4().hex}"
    (outside / "secret.txt").write_text(secret)
    # A DAG Airflow knows that has no report folder (only nightly_training writes reports).
    dag_id = next(dag["dag_id"] for dag in api.get("/api/v2/dags?limit=100")["dags"]
                  if dag["dag_id"] != "nightly_training" and not (storage / "reports" / dag["dag_id"]).exists())
    linked_dag = storage / "reports" / dag_id
    os.symlink(outside / "secret.txt", run / "leak.txt")
    os.symlink(outside, run / "outside")
    os.symlink(storage / "models", run / "models")
    os.symlink(outside, linked_dag)
    try:
        for path in (f"nightly_training/{run.name}/leak.txt", f"nightly_training/{run.name}/outside/secret.txt",
                     f"nightly_training/{run.name}/models/propensity/registry.json", f"{dag_id}/secret.txt"):
            status, body = fetch(f"{api.base_url}/hybridflow/reports/{path}", api.token)
            assert status == 404 and secret not in body and "champion" not in body, (path, status, body)
        assert_still_healthy(api)
    finally:
        linked_dag.unlink()
        shutil.rmtree(outside)


def test_ui_slurm_job_page_shows_the_record_and_log_tail(api, stack):
    hook = SlurmHook()
    log_dir = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/test-ui/logs"
    try:
        hook.run(["mkdir", "-p", "--", log_dir])
        spec = SlurmJobSpec(job_name=f"hf-test-ui-{uuid.uuid4().hex[:6]}", partition="cpu",
                            command=["bash", "-c", "echo visible-in-the-ui"], time_limit=1, requeue=False,
                            signal=None, output=f"{log_dir}/%x-%j.out", error=f"{log_dir}/%x-%j.err")
        job_id = hook.submit(render_sbatch_script(spec))
        for _ in range(60):
            status = hook.status(job_id)
            if status is not None and status.state == "COMPLETED":
                break
            time.sleep(1)
    finally:
        hook.close()
    status, body = fetch(f"{api.base_url}/hybridflow/slurm/jobs/{job_id}", api.token)
    assert status == 200 and "COMPLETED" in body and "visible-in-the-ui" in body


@pytest.mark.parametrize("job_id", ["1%3Brm", "1_", "_1", "1_2_3", "1%20", "%201", "-1", "%EF%BC%91", "1%00",
                                    "1%0D", "12345678901", "1%0A", "1_5%0A"])
def test_ui_slurm_job_id_must_be_a_whole_job_id(api, job_id):
    status, body = fetch(f"{api.base_url}/hybridflow/slurm/jobs/{job_id}", api.token)
    if job_id.endswith("%0A"):
        # Starlette's router already refuses a path ending in a newline; the page's own check refuses it too
        # (tests/unit/test_ui_paths.py), so it is a 4xx either way.
        assert status in (400, 404), (status, body)
    else:
        assert status == 400 and "job_id must be a Slurm job id" in body, (status, body)
    assert_still_healthy(api)
