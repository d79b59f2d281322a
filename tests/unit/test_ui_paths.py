"""The pure checks behind the UI pages (hybridflow.ui): which DAG ids, report paths and Slurm job ids are served.

Paths reach these checks percent-decoded (the server decodes `%2F`, `%5C`, `%00` before routing), so the hostile
inputs below are written decoded."""

from __future__ import annotations

import os

import pytest
from hybridflow.ui import MlflowRunLink, SlurmJobLink, create_app, is_dag_id, is_job_id, report_parts, resolve_report

# --- DAG ids ---------------------------------------------------------------------------------------------------

GOOD_DAG_IDS = ["nightly_training", "cluster_preflight", "a", "_private", "team.etl-v2", "A1", "x" * 250]
BAD_DAG_IDS = [
    "", ".", "..", "...", ".hidden", "-rf", "a/b", "a\\b", "/etc", "a\x00", "\x00", "nightly_training\n",
    "nightly_training\r", "a\tb", "a b", " a", "a\x7f", "a\x85", "caf\u00e9", "\u202enightly", "%2e%2e", "a%2Fb",
    "x" * 251, "a:b",
]


@pytest.mark.parametrize("dag_id", GOOD_DAG_IDS)
def test_dag_id_accepts_airflow_ids(dag_id):
    assert is_dag_id(dag_id)


@pytest.mark.parametrize("dag_id", BAD_DAG_IDS, ids=ascii)
def test_dag_id_rejects_dots_separators_controls_and_overlong(dag_id):
    assert not is_dag_id(dag_id)


# --- report paths ----------------------------------------------------------------------------------------------

GOOD_PATHS = [
    ("report.html", ("report.html",)),
    ("ds=2026-01-01/manual__2026-01-01T00_00_00_00_00/report.html",
     ("ds=2026-01-01", "manual__2026-01-01T00_00_00_00_00", "report.html")),
    ("ds=2026-01-01/run/loss_curve.png", ("ds=2026-01-01", "run", "loss_curve.png")),
    ("n" * 255, ("n" * 255,)),
]
BAD_PATHS = [
    # NUL and every other kind of control character, also ones `$` or a terminal treat specially
    "report.html\x00.png", "\x00", "report\x01.html", "report.html\x1f", "report.html\x7f", "report.html\x85",
    "report.html\n", "report.html\r", "a\tb", "report\u202e.html", "report\u200b.html",
    # separators and traversal: `..`, `.`, backslashes, encoded and doubled slashes once decoded
    "..", ".", "../report.html", "a/../../models/propensity/registry.json", "a/./report.html", "..\\..\\etc",
    "a\\report.html", "a//report.html", "a/", "a/report.html/", "%2e%2e/report.html", "..%2F..%2Fetc",
    "%252e%252e", ".hidden", "a/.git/config",
    # absolute paths
    "/etc/passwd", "//etc/passwd", "/", "C:\\Windows",
    # overlong: one name past NAME_MAX, the whole path past the limit, empty
    "n" * 256, "/".join(["n" * 200] * 6), "",
    # other characters the report writer never produces
    "caf\u00e9.html", "report .html", "a:b", "a*b", "~root",
]


@pytest.mark.parametrize(("path", "parts"), GOOD_PATHS, ids=[p[:40] for p, _ in GOOD_PATHS])
def test_report_parts_accepts_what_the_report_writer_produces(path, parts):
    assert report_parts(path) == parts


@pytest.mark.parametrize("path", BAD_PATHS, ids=lambda p: ascii(p)[:40])
def test_report_parts_rejects_controls_separators_absolute_and_overlong(path):
    assert report_parts(path) is None


@pytest.fixture
def store(tmp_path):
    """A storage root: reports of two DAGs, a secret outside the report store, and symlinks out of it."""
    root = tmp_path / "storage"
    reports = root / "reports"
    run = reports / "nightly_training" / "ds=2026-01-01" / "run"
    run.mkdir(parents=True)
    (run / "report.html").write_text("<h1>ok</h1>")
    (reports / "other_dag").mkdir()
    (reports / "other_dag" / "report.html").write_text("other")
    (root / "models").mkdir()
    (root / "models" / "registry.json").write_text("{}")
    os.symlink(root / "models" / "registry.json", run / "leak.json")  # a file symlink out of the store
    os.symlink(reports / "other_dag" / "report.html", run / "other.html")  # into another DAG's folder
    os.symlink(root / "models", run / "models")  # a folder symlink out of the store
    os.symlink("loop", run / "loop")  # a symlink loop
    os.symlink(root, reports / "linked_dag")  # a DAG folder that is itself a symlink
    return reports


def test_resolve_report_serves_a_file_inside_the_dag_folder(store):
    found = resolve_report(store, "nightly_training", "ds=2026-01-01/run/report.html")
    assert found is not None and found.read_text() == "<h1>ok</h1>"


@pytest.mark.parametrize(("dag_id", "path"), [
    ("nightly_training", "ds=2026-01-01/run/leak.json"),
    ("nightly_training", "ds=2026-01-01/run/other.html"),
    ("nightly_training", "ds=2026-01-01/run/models/registry.json"),
    ("nightly_training", "ds=2026-01-01/run/loop"),
    ("linked_dag", "models/registry.json"),
    ("linked_dag", "reports/nightly_training/ds=2026-01-01/run/report.html"),
    ("nightly_training", "ds=2026-01-01/run"),  # a folder
    ("nightly_training", "ds=2026-01-01/run/missing.html"),
    ("..", "models/registry.json"),
    (".", "nightly_training/ds=2026-01-01/run/report.html"),
    ("nightly_training", "ds=2026-01-01/run/report.html\x00.png"),
    ("nightly_training", "n" * 256),
])
def test_resolve_report_refuses_symlinks_out_of_the_dag_folder_and_hostile_names(store, dag_id, path):
    assert resolve_report(store, dag_id, path) is None


# --- Slurm job ids ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("job_id", ["1", "1234", "1234_5", "4294967295", "4294967295_4294967295"])
def test_job_id_accepts_jobs_and_array_tasks(job_id):
    assert is_job_id(job_id)


@pytest.mark.parametrize("job_id", [
    "", "1\n", "1_5\n", "\n1", "1\r", "1 ", " 1", "1;rm", "1_", "_1", "1__2", "1_2_3", "-1", "+1", "0x1", "1.0",
    "\uff11", "\u0661\u0662", "1\x00", "12345678901",
], ids=ascii)
def test_job_id_rejects_trailing_newline_and_anything_but_whole_ids(job_id):
    assert not is_job_id(job_id)


@pytest.mark.parametrize(("xcom", "linked"), [("1234", True), ("1234_5", True), ("1234\n", False),
                                            ("1;rm -rf /", False), (None, False)], ids=ascii)
def test_slurm_job_link_only_for_whole_job_ids(monkeypatch, xcom, linked):
    from airflow.providers.common.compat.sdk import XCom

    monkeypatch.setattr(XCom, "get_value", lambda **_: xcom)
    link = SlurmJobLink().get_link(None, ti_key=None)
    assert link.endswith(f"/hybridflow/slurm/jobs/{xcom}") if linked else link == ""


RUN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("xcom", "linked"), [
    (f"http://127.0.0.1:5000/#/experiments/9/runs/{RUN}", True),
    (f"https://mlflow.example.com/mlflow/#/experiments/1/runs/{RUN}", True),
    (f"http://[::1]:5000/#/experiments/9/runs/{RUN}", True),
    (f"javascript:alert(1)//#/experiments/9/runs/{RUN}", False),
    (f"http://127.0.0.1:5000/#/experiments/9/runs/{RUN}\n", False),
    (f"http://127.0.0.1:5000/#/experiments/9/runs/{RUN}?x=<script>", False),
    (f"http://user:pw@host/#/experiments/9/runs/{RUN}", False),  # never a URL with credentials
    (f"http://127.0.0.1:5000/#/experiments/a/runs/{RUN}", False),
    ("http://127.0.0.1:5000/#/experiments/9/runs/XYZ", False),
    (f"//evil.example/#/experiments/9/runs/{RUN}", False),
    ("", False), (None, False), (42, False), ({"url": "x"}, False),
], ids=ascii)
def test_mlflow_run_link_only_for_run_pages_of_an_http_server(monkeypatch, xcom, linked):
    from airflow.providers.common.compat.sdk import XCom

    monkeypatch.setattr(XCom, "get_value", lambda **_: xcom)
    link = MlflowRunLink().get_link(None, ti_key=None)
    assert link == (xcom if linked else "")


# --- the app ---------------------------------------------------------------------------------------------------

def test_app_has_no_unauthenticated_docs_or_schema():
    app = create_app()
    assert (app.docs_url, app.redoc_url, app.openapi_url) == (None, None, None)
    assert {route.path for route in app.routes} == {"/reports/{dag_id}/{path:path}", "/slurm/jobs/{job_id}",
                                                       "/utilization"}
