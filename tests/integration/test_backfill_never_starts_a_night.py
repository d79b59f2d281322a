"""A backfill, or a pause and unpause, never makes Airflow start a night that has already passed.

Airflow's DAG processor recomputes ``next_dagrun`` on every parse from the latest SCHEDULED *or* BACKFILL_JOB run;
with a plain ``CronTriggerTimetable`` and ``catchup=False`` that is the latest elapsed tick, which the scheduler then
runs at once beside the backfill. This drives Airflow's real DAG processor and scheduler (their own processes, the
project's plugins folder) on an Airflow home of its own: the shared stack's running components keep the plugin list
they started with, and a scheduled run of a throw-away DAG must never meet the suite's own DAGs. Its metadata is in
a PostgreSQL cluster of its own (``pgstack``, ~3 s), not in SQLite: with three writers (DAG processor, scheduler,
CLI) SQLite failed ``backfill create`` at once with "database is locked" in CI (2026-12-07): the backfill reads in
a SAVEPOINT and then inserts, and SQLite refuses that upgrade without waiting when another writer got in between.
Nor in the stack's PostgreSQL: this test's lane runs beside the one that SIGKILLs it.

Two throw-away DAGs on a daily tick that passed 3 hours ago, tasks in a pool that does not exist (nothing executes):
``guard_backfill`` is unpaused, backfilled for 3 past nights, then paused and unpaused; ``guard_unpause`` has a start
date a week back and is unpaused for the first time. Neither may get a scheduled run; both wait for tomorrow's tick.
``HYBRIDFLOW_GUARD_TIMETABLE=plain`` runs the same scenario with Airflow's ``CronTriggerTimetable`` (it fails).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pgstack  # scripts/ is on the test path (pyproject.toml)
import pytest
import sqlalchemy
from helpers.waiting import wait_until
from stack.common import P

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).parent / "airflow")
PLAIN = os.environ.get("HYBRIDFLOW_GUARD_TIMETABLE", "") == "plain"
# Long enough for a dozen parses (every 5 s here) and scheduler loops after each step.
SETTLE_S = 45

DAG_FILE = '''
from datetime import datetime
from airflow.sdk import DAG, task
{import_line}

for dag_id, start in (("guard_backfill", None), ("guard_unpause", datetime.fromisoformat("{start}"))):
    with DAG(dag_id, schedule={timetable}("{cron}", timezone="UTC"), start_date=start, catchup=False,
             is_paused_upon_creation=True):
        @task(pool="guard_never_opened")  # a pool that does not exist: runs start, their task never does
        def noop():
            pass

        noop()
'''


@pytest.fixture
def metadata_url(tmp_path):
    """The SQLAlchemy URL of a fresh PostgreSQL cluster of this test's own (under cluster_dir, where the postgres
    user can reach it), on a free loopback port; stopped and removed when the test ends."""
    data_dir = Path(tempfile.mkdtemp(dir=P.cluster / "postgres", prefix="test-backfill-"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = pgstack.ensure_cluster(data_dir, port, tmp_path / "secrets", log=lambda line: None)
    pid = pgstack.start(data_dir, port, tmp_path / "postgres.log")
    try:
        wait_until("the test's PostgreSQL accepts connections", lambda: pgstack.ready(port), timeout_s=60, every_s=0.2)
        yield url
    finally:
        pgstack.stop(pid, data_dir=data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def as_utc(value: datetime | None) -> datetime | None:
    return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)


@pytest.fixture
def airflow_home(tmp_path, metadata_url):
    """A migrated Airflow home with the project's plugins, its metadata in the test's own PostgreSQL; the DAG
    processor and scheduler it starts are stopped, process group by process group, when the test ends. Yields
    the home, ``start``, ``cli`` and ``rows`` (a read of the metadata database)."""
    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=metadata_url,
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"), AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__EXECUTOR="LocalExecutor",
               # No task runs here; should one try, it must not reach the shared stack's api-server.
               AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:9/execution/",
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5", AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="5",
               AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK="False", AIRFLOW__LOGGING__LOGGING_LEVEL="INFO")
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    started: list[subprocess.Popen] = []

    def start(*argv: str) -> subprocess.Popen:
        log = open(home / f"{argv[0]}.log", "wb")  # noqa: SIM115 - kept open for the process's lifetime
        proc = subprocess.Popen([AIRFLOW, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        started.append(proc)
        return proc

    def cli(*argv: str) -> str:
        out = subprocess.run([AIRFLOW, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"airflow {' '.join(argv)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return out.stdout

    engine = sqlalchemy.create_engine(metadata_url, poolclass=sqlalchemy.NullPool)

    def rows(sql: str, **params) -> list[tuple]:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sqlalchemy.text(sql), params)]

    yield home, start, cli, rows
    engine.dispose()
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: the component and its children
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_backfill_and_unpause_never_start_a_past_night(airflow_home):
    home, start, cli, rows = airflow_home
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    last_tick = now - timedelta(hours=3)  # tonight's tick is 21 h away
    next_tick = last_tick + timedelta(days=1)
    timetable = "CronTriggerTimetable" if PLAIN else "NoMissedRunCronTimetable"
    import_line = ("from airflow.timetables.trigger import CronTriggerTimetable" if PLAIN
                   else "from hybridflow.timetables import NoMissedRunCronTimetable")
    (home / "dags" / "guard_dags.py").write_text(DAG_FILE.format(
        import_line=import_line, timetable=timetable, cron=f"{last_tick.minute} {last_tick.hour} * * *",
        start=(now - timedelta(days=7)).date().isoformat()))

    start("dag-processor")
    wait_until("both DAGs serialized", lambda: len(rows(
        "select dag_id from serialized_dag where dag_id like 'guard_%'")) >= 2, timeout_s=90, every_s=1)
    start("scheduler", "--skip-serve-logs")

    def scheduled_runs() -> list[tuple]:
        return rows("select dag_id, run_id from dag_run where dag_id like 'guard_%' and run_type = 'scheduled'")

    cli("dags", "unpause", "guard_backfill")
    # Three past nights, the newest two days back: the latest automated run is now a backfill's.
    cli("backfill", "create", "--dag-id", "guard_backfill",
        "--from-date", (last_tick - timedelta(days=4, minutes=30)).isoformat(),
        "--to-date", (last_tick - timedelta(days=2) + timedelta(minutes=30)).isoformat())
    backfill = rows("select run_id from dag_run where dag_id = 'guard_backfill' and run_type = 'backfill'")
    assert len(backfill) == 3, backfill
    # The scheduler really reads the DAG (it deserializes the plugin's timetable): it starts the backfill's runs.
    wait_until("a backfill run started", lambda: rows(
        "select 1 from dag_run where dag_id = 'guard_backfill' and run_type = 'backfill' and state = 'running'"),
        timeout_s=90, every_s=1)
    time.sleep(SETTLE_S)
    assert scheduled_runs() == [], "a backfill made the scheduler start a past night"

    cli("dags", "pause", "guard_backfill")
    time.sleep(10)
    cli("dags", "unpause", "guard_backfill")
    cli("dags", "unpause", "guard_unpause")  # first unpause, start date a week back: 7 missed nights
    time.sleep(SETTLE_S)
    assert scheduled_runs() == [], "unpausing started a missed night"

    for dag_id in ("guard_backfill", "guard_unpause"):
        (next_dagrun, create_after), = rows(
            "select next_dagrun, next_dagrun_create_after from dag where dag_id = :dag_id", dag_id=dag_id)
        assert as_utc(next_dagrun) == next_tick, (dag_id, next_dagrun)
        assert as_utc(create_after) == next_tick, (dag_id, create_after)
    failures = [line for path in home.glob("*.log") for line in path.read_text(errors="replace").splitlines()
                if "Failed to deserialize" in line or "is not registered" in line]
    assert failures == []
