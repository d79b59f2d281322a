"""A run's deadline: a DAG run not done some time after it was queued alerts on-call (kind ``late``) with the
stage it is in and the state of each unfinished task, through the same sinks and dedup as failures.

Airflow's deadline alerts do the timing: the scheduler records the deadline when the run is queued, drops it
when the run ends, and when it passes queues :func:`missed_deadline` in the triggerer (an ``AsyncCallback``) with
the run (``context["dag_run"]``); the callback reads the run's task states through the triggerer's API.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from hybridflow.notifiers.oncall import LATE, Alert, OnCallNotifier, build_alert

# A task in one of these has not finished; the first in the DAG's order names the stage.
UNFINISHED = ("running", "deferred", "awaiting_input", "up_for_retry", "up_for_reschedule", "queued", "scheduled",
              "restarting")


def late_alert(dag_id: str, run_id: str, task_states: Mapping[str, str | None], deadline_s: float,
               queued_at: str | None = None, now: datetime | None = None) -> Alert:
    """The alert of a run past its deadline: the stage of its first unfinished task (running before queued),
    and every unfinished task with its state."""
    unfinished = sorted(((task, state) for task, state in task_states.items() if state in UNFINISHED),
                        key=lambda item: UNFINISHED.index(item[1]))
    done = sum(1 for state in task_states.values() if state in ("success", "skipped"))
    failed = [task for task, state in task_states.items() if state in ("failed", "upstream_failed")]
    where = (f"stage {unfinished[0][0].split('.', 1)[0]} ({unfinished[0][0]}: {unfinished[0][1]})" if unfinished
             else "no task running (the run waits to be scheduled)")
    error = (f"not done {deadline_s / 60:g} min after it was queued{f' at {queued_at}' if queued_at else ''}: "
             f"{where}")
    details = [f"{task}: {state}" for task, state in unfinished]
    details.append(f"{done} of {len(task_states)} tasks done" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return build_alert(dag_id=dag_id, run_id=run_id, task_id=unfinished[0][0] if unfinished else None,
                       try_number=None, error=error, remote_log_tail="\n".join(details), kind=LATE, now=now)


async def missed_deadline(context: dict[str, Any], deadline_s: float, sink_conn_id: str = "",
                          dedup_window_s: float = 3600.0) -> str:
    """The DeadlineAlert callback (runs in the triggerer): alert on-call that the run is late, and where."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from asgiref.sync import sync_to_async

    dag_run = context["dag_run"]
    dag_id, run_id = dag_run["dag_id"], dag_run["dag_run_id"]
    states = await sync_to_async(RuntimeTaskInstance.get_task_states)(dag_id=dag_id, run_ids=[run_id])
    alert = late_alert(dag_id, run_id, states.get(run_id) or {}, deadline_s, dag_run.get("queued_at"),
                       datetime.now(UTC))
    notifier = OnCallNotifier(sink_conn_id=sink_conn_id or None, dedup_window_s=dedup_window_s)
    await sync_to_async(notifier.send)(alert)
    return alert.error
