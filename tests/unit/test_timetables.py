"""NoMissedRunCronTimetable: with catch-up off a tick already past (beyond the grace) is never offered, whatever run
the DAG processor hands it as the latest automated one (a backfill's, or a scheduled run from before a pause)."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pendulum
import pytest
from airflow.timetables import trigger
from airflow.timetables.base import DataInterval, TimeRestriction
from airflow.timetables.trigger import CronTriggerTimetable
from hybridflow.timetables import DEFAULT_GRACE, NoMissedRunCronTimetable, cron_schedule

REPO = Path(__file__).resolve().parents[2]
NIGHTLY = "0 2 * * *"


def at(text: str) -> pendulum.DateTime:
    return pendulum.parse(text, tz="UTC")


def night(day: str) -> DataInterval:
    """The data interval of the run of the 02:00 tick of ``day`` (trigger timetables: a zero-length interval)."""
    tick = at(f"{day}T02:00:00")
    return DataInterval(tick, tick)


@pytest.fixture
def freeze(monkeypatch):
    """Sets the timetables' "now": both the parent's clock and ours read ``airflow.timetables.trigger.utcnow``."""

    def set_now(text: str) -> None:
        monkeypatch.setattr(trigger, "utcnow", lambda: at(text))

    return set_now


def next_tick(timetable, last: DataInterval | None, *, catchup=False, earliest=None, latest=None):
    info = timetable.next_dagrun_info(last_automated_data_interval=last,
                                      restriction=TimeRestriction(earliest, latest, catchup))
    return None if info is None else info.run_after.isoformat()


# (case, now, latest automated run, kwargs, what plain CronTriggerTimetable offers, what ours offers)
CASES = [
    ("backfill of 3 past nights, created in the afternoon", "2026-12-03T15:56:00", night("2026-11-30"), {},
     "2026-12-03T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("unpaused after 5 missed nights", "2026-12-03T09:00:00", night("2026-11-28"), {},
     "2026-12-03T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("last night ran: the next night", "2026-12-03T15:56:00", night("2026-12-03"), {},
     "2026-12-04T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("exactly at the tick", "2026-12-03T02:00:00", night("2026-12-02"), {},
     "2026-12-03T02:00:00+00:00", "2026-12-03T02:00:00+00:00"),
    ("scheduler back 10 min late: within the grace, still runs", "2026-12-03T02:10:00", night("2026-12-02"), {},
     "2026-12-03T02:00:00+00:00", "2026-12-03T02:00:00+00:00"),
    ("scheduler back 20 min late: past the grace, skipped", "2026-12-03T02:20:00", night("2026-12-02"), {},
     "2026-12-03T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("catchup on: the next night after the backfill, as before", "2026-12-03T15:56:00", night("2026-11-30"),
     {"catchup": True}, "2026-12-01T02:00:00+00:00", "2026-12-01T02:00:00+00:00"),
    ("first run ever, no start date: waits for tonight", "2026-12-03T15:56:00", None, {},
     "2026-12-04T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("first unpause with a start date a week ago", "2026-12-03T15:56:00", None,
     {"earliest": at("2026-11-26T00:00:00")}, "2026-12-03T02:00:00+00:00", "2026-12-04T02:00:00+00:00"),
    ("start date in the future", "2026-12-03T15:56:00", None, {"earliest": at("2026-12-10T00:00:00")},
     "2026-12-10T02:00:00+00:00", "2026-12-10T02:00:00+00:00"),
    ("end date before the next night: no more runs", "2026-12-03T15:56:00", night("2026-11-30"),
     {"latest": at("2026-12-03T12:00:00")}, "2026-12-03T02:00:00+00:00", None),
]


@pytest.mark.parametrize(("case", "now", "last", "kwargs", "plain", "ours"), CASES, ids=[c[0] for c in CASES])
def test_next_run(freeze, case, now, last, kwargs, plain, ours):
    freeze(now)
    assert next_tick(CronTriggerTimetable(NIGHTLY, timezone="UTC"), last, **kwargs) == plain  # the mechanism
    assert next_tick(NoMissedRunCronTimetable(NIGHTLY, timezone="UTC"), last, **kwargs) == ours


def test_run_immediately_still_decides_the_first_run(freeze):
    freeze("2026-12-03T15:56:00")
    timetable = NoMissedRunCronTimetable(NIGHTLY, timezone="UTC", run_immediately=True)
    assert next_tick(timetable, None) == "2026-12-03T02:00:00+00:00"


def test_grace_and_timezone(freeze):
    freeze("2026-12-03T02:40:00")  # 03:40 in Zurich: the 03:00 local tick is 40 min old
    timetable = NoMissedRunCronTimetable("0 3 * * *", timezone="Europe/Zurich", grace=timedelta(hours=1))
    assert next_tick(timetable, None, earliest=at("2026-11-01T00:00:00")) == "2026-12-03T02:00:00+00:00"
    timetable = NoMissedRunCronTimetable("0 3 * * *", timezone="Europe/Zurich")
    assert next_tick(timetable, None, earliest=at("2026-11-01T00:00:00")) == "2026-12-04T02:00:00+00:00"


def test_data_interval_keeps_the_configured_length(freeze):
    freeze("2026-12-03T15:56:00")
    timetable = NoMissedRunCronTimetable(NIGHTLY, timezone="UTC", interval=timedelta(days=1))
    info = timetable.next_dagrun_info(last_automated_data_interval=night("2026-11-30"),
                                      restriction=TimeRestriction(None, None, False))
    assert info.data_interval == DataInterval(at("2026-12-03T02:00:00"), at("2026-12-04T02:00:00"))


def test_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace"):
        NoMissedRunCronTimetable(NIGHTLY, timezone="UTC", grace=timedelta(minutes=-1))


def plugin_timetables() -> list[type]:
    spec = importlib.util.spec_from_file_location("hybridflow_ui_plugin", REPO / "plugins" / "hybridflow_ui.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HybridflowUiPlugin.timetables


def test_serialization_round_trip_through_the_plugin(monkeypatch):
    """What the DAG processor stores and the scheduler reads back, with the registry the plugin gives them."""
    from airflow import plugins_manager
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    registered = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in plugin_timetables()}
    monkeypatch.setattr(plugins_manager, "get_timetables_plugins", lambda: registered)
    timetable = NoMissedRunCronTimetable(NIGHTLY, timezone="Europe/Zurich", grace=timedelta(minutes=7))
    with DAG("timetable_round_trip", schedule=timetable, catchup=False) as dag:
        pass
    data = DagSerialization.to_dict(dag)
    assert data["dag"]["timetable"]["__type"] == "hybridflow.timetables.NoMissedRunCronTimetable"
    back = DagSerialization.from_dict(data).timetable
    assert type(back) is NoMissedRunCronTimetable
    assert back == timetable and back._grace == timedelta(minutes=7)
    assert back.summary == NIGHTLY
    assert back.description == "At 02:00; a missed run is skipped, not started late"


def test_older_serialized_form_without_grace_gets_the_default():
    back = NoMissedRunCronTimetable.deserialize(
        {"expression": NIGHTLY, "timezone": "UTC", "interval": 0.0, "run_immediately": False})
    assert back._grace == DEFAULT_GRACE


def test_utc_clock_is_the_real_one_by_default():
    # Guards the single patch point above: our class must read the parent module's clock.
    assert abs(trigger.utcnow() - datetime.now(UTC)) < timedelta(seconds=5)


@pytest.mark.parametrize(("configured", "expected"), [
    ("0 2 * * *", NoMissedRunCronTimetable("0 2 * * *", timezone="UTC")),
    ("@weekly", NoMissedRunCronTimetable("0 0 * * 0", timezone="UTC")),
    (" none ", None), ("", None), (None, None), ("@once", "@once"),
])
def test_cron_schedule(configured, expected):
    assert cron_schedule(configured) == expected
