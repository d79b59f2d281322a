"""Running a DAG file once through Airflow's real task lifecycle: airflow_runner.py (next to this module) in a
fresh interpreter on an isolated Airflow home (the ``run_dag`` fixture of tests/conftest.py uses it), and
reading what it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("airflow_runner.py")


def write_dag_file(airflow_env: dict[str, str], source: str, dag_id: str) -> Path:
    """``source`` as ``<dag_id>.py`` in the DAGs folder of ``airflow_env``'s Airflow home."""
    dag_file = Path(airflow_env["AIRFLOW__CORE__DAGS_FOLDER"]) / f"{dag_id}.py"
    dag_file.write_text(source)
    return dag_file


def runner_argv(dag_file: Path, dag_id: str, conf: dict | None = None, logical_date: str = "") -> list[str]:
    """The runner's command line: it prints one ``RESULT <json>`` line (run state, per task state and XComs).
    ``-P``: the runner's own folder stays off its path, so that no helper module here (``triton``, ``spark``)
    can stand in for the library of that name in the run."""
    return [sys.executable, "-P", str(RUNNER), str(dag_file), dag_id, json.dumps(conf or {}), logical_date]


def run_captured(airflow_env: dict[str, str], source: str, dag_id: str, conf: dict,
                 timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Writes the DAG file and runs the runner on it once, its output captured: for a run the trigger form must
    refuse before any task starts (``run_dag`` fails a test whose run prints no result). The caller checks how
    it ended."""
    argv = runner_argv(write_dag_file(airflow_env, source, dag_id), dag_id, conf)
    return subprocess.run(argv, env=airflow_env, capture_output=True, text=True, timeout=timeout_s)


def task_states(result: dict) -> dict[str, str]:
    """Each task's state in a ``run_dag`` result, by task id."""
    return {task_id: task["state"] for task_id, task in result["tasks"].items()}
