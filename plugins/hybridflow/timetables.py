"""A cron timetable whose catch-up-off semantics never start a tick that has already passed.

Airflow's ``CronTriggerTimetable`` with ``catchup=False`` offers the latest *elapsed* tick whenever the last automated
run is older than it. The DAG processor recomputes ``next_dagrun`` on every parse from the latest SCHEDULED *or*
BACKFILL_JOB run (``dag_processing/collection.py``, ``_get_latest_runs_stmt``), so a backfill of past dates, or a
DAG unpaused after missed nights, makes the scheduler start last night at once, hours late, beside the backfill.
``NoMissedRunCronTimetable`` keeps every other rule of its parent and only refuses, with catch-up off, a tick more
than ``grace`` in the past: the next run is then the next future tick. Registered by the ``hybridflow_ui`` plugin
(custom timetables must come from a plugin so the scheduler and api-server can deserialize them).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from airflow._shared.timezones.timezone import coerce_datetime, parse_timezone
from airflow.timetables import trigger
from airflow.timetables.base import DagRunInfo
from airflow.timetables.trigger import CronTriggerTimetable

if TYPE_CHECKING:
    from airflow.timetables.base import DataInterval, TimeRestriction, Timetable
    from dateutil.relativedelta import relativedelta
    from pendulum.tz.timezone import FixedTimezone, Timezone

# How late a tick may still start: covers a scheduler or DAG-processor restart around the tick, not a whole night.
DEFAULT_GRACE = datetime.timedelta(minutes=15)


class NoMissedRunCronTimetable(CronTriggerTimetable):
    """``CronTriggerTimetable`` that, with ``catchup=False``, never schedules a tick more than ``grace`` ago.

    A missed tick (a backfill made it look due, the DAG was paused, the scheduler was down) is skipped, not run late;
    backfills are how the past gets run. With catch-up on, and for a DAG's very first run without a start date
    (``run_immediately`` decides), it behaves exactly as its parent.
    """

    def __init__(
        self,
        cron: str,
        *,
        timezone: str | Timezone | FixedTimezone,
        interval: datetime.timedelta | relativedelta = datetime.timedelta(),
        run_immediately: bool | datetime.timedelta = False,
        grace: datetime.timedelta = DEFAULT_GRACE,
    ) -> None:
        super().__init__(cron, timezone=timezone, interval=interval, run_immediately=run_immediately)
        if grace < datetime.timedelta():
            raise ValueError(f"grace must not be negative, got {grace}")
        self._grace = grace
        if self.description:  # shown by the UI next to the cron summary
            self.description = f"{self.description}; a missed run is skipped, not started late"

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> Timetable:
        from airflow.serialization.decoders import decode_interval, decode_run_immediately

        return cls(
            data["expression"],
            timezone=parse_timezone(data["timezone"]),
            interval=decode_interval(data["interval"]),
            run_immediately=decode_run_immediately(data.get("run_immediately", False)),
            grace=datetime.timedelta(seconds=data.get("grace_s", DEFAULT_GRACE.total_seconds())),
        )

    def serialize(self) -> dict[str, Any]:
        return {**super().serialize(), "grace_s": self._grace.total_seconds()}

    def __eq__(self, other: object) -> bool:
        equal = super().__eq__(other)
        if equal is NotImplemented or not equal:
            return equal
        return self._grace == other._grace  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self._expression, self._timezone, self._grace))

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        info = super().next_dagrun_info(
            last_automated_data_interval=last_automated_data_interval, restriction=restriction)
        if info is None or restriction.catchup:
            return info
        if last_automated_data_interval is None and restriction.earliest is None:
            return info  # a DAG's first run ever: Airflow's run_immediately rule already decides
        # The parent's own clock (one place for tests to freeze it).
        now = coerce_datetime(trigger.utcnow())
        if info.run_after >= now - self._grace:
            return info
        next_tick = self._align_to_next(now)
        if restriction.latest is not None and restriction.latest < next_tick:
            return None
        return DagRunInfo.interval(coerce_datetime(next_tick - self._interval), next_tick)


def cron_schedule(expression: str | None, *, timezone: str = "UTC") -> NoMissedRunCronTimetable | str | None:
    """A DAG's ``schedule=`` for a configured cron: ``NoMissedRunCronTimetable``; None for "none" or empty;
    Airflow's non-cron presets (``@once``, ``@continuous``) as they are."""
    if expression is None or expression.strip().lower() in ("", "none"):
        return None
    if expression.strip() in ("@once", "@continuous"):
        return expression.strip()
    return NoMissedRunCronTimetable(expression.strip(), timezone=timezone)
