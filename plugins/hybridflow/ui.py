"""What the suite adds to the Airflow UI: run reports and Slurm job pages served by the api-server, and the
operator extra links that point at them.

The pages sit behind Airflow's own login (the UI's session cookie or a bearer token): reports need read access to
the DAG, a Slurm job page an authenticated user. A report file is served only for a DAG Airflow knows, and only
from inside that DAG's folder of the report store.
"""

from __future__ import annotations

import html
import mimetypes
import re
from pathlib import Path
from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

URL_PREFIX = "/hybridflow"
# fullmatch only: `$` also matches before a trailing newline. ASCII digits only (`\d` takes any Unicode digit);
# Slurm job and array task ids are uint32, at most 10 digits.
JOB_ID = re.compile(r"[0-9]{1,10}(?:_[0-9]{1,10})?")
# The ASCII part of Airflow's dag id rule (``[\w.-]``, at most 250 chars) with no leading dot or dash, so `.` and
# `..` can never name a report folder.
DAG_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}")
# One path component of what RunReportOperator writes (``ds=<ds>/<run>/<file>``, StorageLayout.report_path): no
# leading dot, so no `.`, `..` or hidden files; no control characters, backslashes, percent signs or non-ASCII; at
# most NAME_MAX bytes.
REPORT_NAME = re.compile(r"[A-Za-z0-9_=-][A-Za-z0-9_.=-]{0,254}")
MAX_REPORT_PATH = 1024


def reports_root() -> Path:
    """The report store of the configured storage root (the pipeline config's, like every other path)."""
    from hybridflow.config import pipeline_config

    return Path(pipeline_config().storage.layout.reports)


def api_base_url() -> str:
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="http://127.0.0.1:8080").rstrip("/")


def report_url(relative_html: str) -> str:
    """The UI URL of a report file given relative to the report store (``<dag_id>/.../report.html``)."""
    return f"{api_base_url()}{URL_PREFIX}/reports/{relative_html.lstrip('/')}"


def slurm_job_url(job_id: str) -> str:
    return f"{api_base_url()}{URL_PREFIX}/slurm/jobs/{job_id}"


def is_job_id(value: str) -> bool:
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


def is_dag_id(value: str) -> bool:
    return isinstance(value, str) and DAG_ID.fullmatch(value) is not None


def report_parts(path: str) -> tuple[str, ...] | None:
    """The components of a report file's path below its DAG's folder; None unless every one is a plain name.

    The path arrives percent-decoded, so `%2F`, `%5C` and `%00` are already `/`, `\\` and NUL here."""
    if not isinstance(path, str) or not path or len(path) > MAX_REPORT_PATH:
        return None
    parts = tuple(path.split("/"))  # a leading, trailing or doubled slash gives an empty part
    return parts if all(REPORT_NAME.fullmatch(part) for part in parts) else None


def resolve_report(root: Path, dag_id: str, path: str) -> Path | None:
    """The file ``root/dag_id/path`` when both are plain names and, symlinks followed, it is a file inside
    ``root/dag_id``; None otherwise. The DAG's folder is not resolved, so a symlinked folder serves nothing."""
    parts = report_parts(path)
    if not is_dag_id(dag_id) or parts is None:
        return None
    base = root.resolve() / dag_id
    try:
        target = base.joinpath(*parts).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a name the OS refuses
        return None
    return target if target.is_relative_to(base) and target.is_file() else None


def read_report_object(root: str, conn_id: str, dag_id: str, path: str) -> bytes | None:
    """The report file ``dag_id/path`` of an object-store root; None unless both are plain names (as
    ``resolve_report`` requires on a disk) and the object exists."""
    from hybridflow.hooks.storage_root import StorageRoot

    parts = report_parts(path)
    if not is_dag_id(dag_id) or parts is None:
        return None
    store = StorageRoot(root, conn_id)
    return store.read_bytes("/".join((store.layout.reports, dag_id, *parts)))


class SlurmJobLink(BaseOperatorLink):
    """From a task that ran a Slurm job to the job's record and log tail."""

    name = "Slurm job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        job_id = XCom.get_value(ti_key=ti_key, key="slurm_job_id")
        return slurm_job_url(str(job_id)) if job_id is not None and is_job_id(str(job_id)) else ""


class RunReportLink(BaseOperatorLink):
    """From the run's report task to the HTML report."""

    name = "Run report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        result = XCom.get_value(ti_key=ti_key, key="return_value") or {}
        relative = result.get("url_path") if isinstance(result, dict) else None
        return report_url(relative) if relative else ""


class MlflowRunLink(BaseOperatorLink):
    """From a training task to its MLflow run (pushed when the run is known, before the job starts)."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        url = XCom.get_value(ti_key=ti_key, key=XCOM_MLFLOW_RUN_URL)
        return url if is_mlflow_run_url(url) else ""


XCOM_MLFLOW_RUN_URL = "mlflow_run_url"
# what the MLflow hook's run_url makes: http(s), a host, then the UI's run route; nothing else is ever linked
MLFLOW_RUN_URL = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/-]*)?/#/experiments/[0-9]{1,19}/runs/[0-9a-f]{32}")


def is_mlflow_run_url(value) -> bool:
    return isinstance(value, str) and MLFLOW_RUN_URL.fullmatch(value) is not None


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
    from airflow.models.dag import DagModel
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, Response

    from hybridflow.config import pipeline_config

    # No /docs, /redoc or /openapi.json: FastAPI serves them without Airflow's login.
    app = FastAPI(title="hybridflow", description="Run reports and Slurm job pages", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def not_found() -> HTTPException:
        # A new one each time: a raised instance keeps its traceback and would grow with every re-raise.
        return HTTPException(404, "no such report file")

    def plain_dag_id(dag_id: str) -> None:
        # Before the access check, so it only ever sees the id the file is then looked up under.
        if not is_dag_id(dag_id):
            raise not_found()

    def known_dag(dag_id: str) -> None:
        # After the access check, so a user without access cannot probe which DAGs exist.
        if DagModel.get_dagmodel(dag_id) is None:
            raise not_found()

    report_checks = [Depends(requires_authenticated()), Depends(plain_dag_id), Depends(requires_access_dag("GET")),
                     Depends(known_dag)]

    @app.get("/reports/{dag_id}/{path:path}", dependencies=report_checks)
    def report_file(dag_id: str, path: str):
        storage = pipeline_config().storage
        if storage.root.startswith("s3://"):  # through the storage connection; names checked as on a disk
            body = read_report_object(storage.root, storage.conn_id, dag_id, path)
            if body is None:
                raise not_found()
            return Response(body, media_type=mimetypes.guess_type(path)[0] or "application/octet-stream")
        found = resolve_report(reports_root(), dag_id, path)
        if found is None:
            raise not_found()
        return FileResponse(found)

    @app.get("/slurm/jobs/{job_id}", response_class=HTMLResponse, dependencies=[Depends(requires_authenticated())])
    def slurm_job(job_id: str):
        if not is_job_id(job_id):
            raise HTTPException(400, "job_id must be a Slurm job id such as 1234 or 1234_5")
        return HTMLResponse(f"<!doctype html><html><body>{slurm_job_page(job_id)}</body></html>")

    @app.get("/utilization", response_class=HTMLResponse, dependencies=[Depends(requires_authenticated())])
    def utilization():
        return HTMLResponse(utilization_page())

    return app


def utilization_page() -> str:
    """The GPU partition ledger's last 30 days, each configured partition (pipeline/utilization.py)."""
    from datetime import date

    from hybridflow.config import pipeline_config
    from hybridflow.pipeline.utilization import page_html, read_days

    config = pipeline_config()
    today, target = date.today(), config.utilization
    return page_html({partition: read_days(config.storage.layout, partition, today)
                      for partition in target.partitions}, target.target, target.alert_days)
