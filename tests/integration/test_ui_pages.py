"""The pages the suite adds to the running Airflow api-server (plugins/hybridflow_ui.py): behind Airflow's login,
run reports served only from the report store, a Slurm job's record and log tail."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from hybridflow.hooks.slurm import SlurmHook
from hybridflow.utils.slurm import SlurmJobSpec, render_sbatch_script

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from airflow_api import local_api  # noqa: E402


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


def test_ui_pages_need_a_login(api):
    status, _ = fetch(f"{api.base_url}/hybridflow/slurm/jobs/1")
    assert status == 401


def test_ui_report_is_served_from_the_report_store_only(api, stack):
    store = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "reports" / "nightly_training" / f"test-{uuid.uuid4().hex[:6]}"
    store.mkdir(parents=True)
    (store / "report.html").write_text("<h1>figures</h1>")
    try:
        relative = f"{store.name}/report.html"
        status, body = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/{relative}", api.token)
        assert (status, body) == (200, "<h1>figures</h1>")
        for hostile in ("..%2F..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", f"{store.name}/..%2F..%2F..%2Fmodels"):
            status, _ = fetch(f"{api.base_url}/hybridflow/reports/nightly_training/{hostile}", api.token)
            assert status == 404, hostile
    finally:
        (store / "report.html").unlink()
        store.rmdir()


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
    status, body = fetch(f"{api.base_url}/hybridflow/slurm/jobs/1%3Brm", api.token)
    assert status == 400 and "job_id must be a Slurm job id" in body
