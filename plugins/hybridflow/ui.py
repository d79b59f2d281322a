"""What the suite adds to the Airflow UI: run reports and Slurm job pages served by the api-server, and the
operator extra links that point at them.

The pages sit behind Airflow's own login (the UI's session cookie or a bearer token): reports need read access to
the DAG, a Slurm job page an authenticated user. Files are served only from inside the report store.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

URL_PREFIX = "/hybridflow"
JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


def storage_root() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_STORAGE_ROOT", "/var/lib/hybridflow/storage"))


def reports_root() -> Path:
    return storage_root() / "reports"


def api_base_url() -> str:
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="http://127.0.0.1:8080").rstrip("/")


def report_url(relative_html: str) -> str:
    """The UI URL of a report file given relative to the report store (``<dag_id>/.../report.html``)."""
    return f"{api_base_url()}{URL_PREFIX}/reports/{relative_html.lstrip('/')}"


def slurm_job_url(job_id: str) -> str:
    return f"{api_base_url()}{URL_PREFIX}/slurm/jobs/{job_id}"


def resolve_inside(base: Path, relative: str) -> Path | None:
    """``base/relative`` when it stays inside ``base`` and is a file; None for traversal or a missing file."""
    base = base.resolve()
    target = (base / relative).resolve()
    if target != base and base not in target.parents:
        return None
    return target if target.is_file() else None


class SlurmJobLink(BaseOperatorLink):
    """From a task that ran a Slurm job to the job's record and log tail."""

    name = "Slurm job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        job_id = XCom.get_value(ti_key=ti_key, key="slurm_job_id")
        return slurm_job_url(str(job_id)) if job_id and JOB_ID.match(str(job_id)) else ""


class RunReportLink(BaseOperatorLink):
    """From the run's report task to the HTML report."""

    name = "Run report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        result = XCom.get_value(ti_key=ti_key, key="return_value") or {}
        relative = result.get("url_path") if isinstance(result, dict) else None
        return report_url(relative) if relative else ""


def slurm_job_page(job_id: str) -> str:
    from hybridflow.config import pipeline_config
    from hybridflow.hooks.slurm import SlurmHook

    hook = SlurmHook(pipeline_config().cluster.ssh_conn_id)
    try:
        status = hook.status(job_id)
        if status is None:
            return f"<p>Slurm has no record of job {html.escape(job_id)}.</p>"
        out = hook.tail(status.stdout_path, 60) if status.stdout_path else ""
        err = hook.tail(status.stderr_path, 60) if status.stderr_path else ""
    finally:
        hook.close()
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in status.to_event().items())
    return (f"<h1>Slurm job {html.escape(job_id)}</h1><table>{rows}</table>"
            f"<h2>stdout (last lines)</h2><pre>{html.escape(out or '(empty)')}</pre>"
            f"<h2>stderr (last lines)</h2><pre>{html.escape(err or '(empty)')}</pre>")


def create_app():
    from airflow.api_fastapi.core_api.security import requires_access_dag, requires_authenticated
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse

    app = FastAPI(title="hybridflow", description="Run reports and Slurm job pages")

    @app.get("/reports/{dag_id}/{path:path}", dependencies=[Depends(requires_access_dag("GET"))])
    def report_file(dag_id: str, path: str):
        found = resolve_inside(reports_root() / dag_id, path)
        if found is None:
            raise HTTPException(404, f"no report file {path!r} for {dag_id}")
        return FileResponse(found)

    @app.get("/slurm/jobs/{job_id}", response_class=HTMLResponse, dependencies=[Depends(requires_authenticated())])
    def slurm_job(job_id: str):
        if not JOB_ID.match(job_id):
            raise HTTPException(400, "job_id must be a Slurm job id such as 1234 or 1234_5")
        return HTMLResponse(f"<!doctype html><html><body>{slurm_job_page(job_id)}</body></html>")

    return app
