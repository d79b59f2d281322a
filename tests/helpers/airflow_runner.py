"""Runs a DAG file's DAG once with ``dag.test()`` in a fresh interpreter and an isolated Airflow home.

Used by integration tests that need a real Airflow task lifecycle (execute, defer, trigger, resume) without
racing the stack's running scheduler for its SQLite file. Prints one JSON line: the run state and, per task,
its state and XComs.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime


def main(dag_file: str, dag_id: str, conf_json: str, logical_date: str = "") -> None:
    from airflow.models.xcom import XComModel
    from airflow.utils.cli import get_bagged_dag
    from airflow.utils.session import create_session

    dag = get_bagged_dag(bundle_names=None, dag_id=dag_id, dagfile_path=dag_file)  # parses and serializes it
    # The same logical date gives the same run id: running it again is what a new try of its tasks sees.
    moment = datetime.fromisoformat(logical_date) if logical_date else None
    when = {"logical_date": moment, "run_after": moment} if moment else {}
    run = dag.test(run_conf=json.loads(conf_json), **when)
    tasks = {}
    with create_session() as session:
        for ti in run.get_task_instances(session=session):
            xcoms = session.query(XComModel).filter_by(dag_id=dag_id, run_id=run.run_id, task_id=ti.task_id).all()
            tasks[ti.task_id] = {"state": str(ti.state), "try_number": ti.try_number,
                                 "xcom": {x.key: x.value for x in xcoms}}
    print("RESULT " + json.dumps({"state": str(run.state), "run_id": run.run_id, "tasks": tasks}, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:5])
