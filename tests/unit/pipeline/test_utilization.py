"""The ledger over days (pipeline/utilization.py): the days a run computes, the stored rows, the under-target
streak behind the on-call alert, and the page's charts. Files are real (tmp_path); no Slurm here."""

from __future__ import annotations

import os
import re
from datetime import date, datetime

import pytest
from hybridflow.layout import StorageLayout
from hybridflow.pipeline.utilization import (
    MAX_RANGE_DAYS,
    day_window,
    days_from_params,
    page_html,
    read_days,
    read_job_figures,
    store_day,
    under_target_alerts,
    under_target_streak,
)

RUN_DAY = date(2026, 12, 5)


@pytest.mark.parametrize("params, expected", [
    ({}, [date(2026, 12, 4), RUN_DAY]),  # the day that ended, and the run's day so far
    ({"start_day": "", "end_day": ""}, [date(2026, 12, 4), RUN_DAY]),
    ({"start_day": "2026-11-30"}, [date(2026, 11, 30)]),
    ({"start_day": "2026-11-30", "end_day": "2026-12-02"}, [date(2026, 11, 30), date(2026, 12, 1), date(2026, 12, 2)]),
    ({"end_day": "2026-12-05"}, [date(2026, 12, 4), RUN_DAY]),
])
def test_the_days_a_run_computes(params, expected):
    assert days_from_params(params, RUN_DAY) == expected


@pytest.mark.parametrize("params, message", [
    ({"start_day": "2026-02-30"}, "start_day: '2026-02-30' is not a calendar day; give YYYY-MM-DD"),
    ({"start_day": "2026-12-05", "end_day": "2026-13-01"}, "end_day: '2026-13-01' is not a calendar day"),
    ({"start_day": "2026-12-05", "end_day": "2026-12-04"}, "end_day 2026-12-04 is before start_day 2026-12-05"),
    ({"start_day": "2026-01-01", "end_day": "2026-12-31"}, f"compute at most {MAX_RANGE_DAYS} days per run"),
])
def test_bad_days_are_refused_naming_the_field(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        days_from_params(params, RUN_DAY)


@pytest.mark.parametrize("now, expected", [
    (datetime(2026, 12, 6, 0, 30), (datetime(2026, 12, 5), datetime(2026, 12, 6))),  # the day that ended
    (datetime(2026, 12, 5, 13, 0), (datetime(2026, 12, 5), datetime(2026, 12, 5, 13))),  # under way: so far
    (datetime(2026, 12, 5, 0, 0), None),  # not begun
    (datetime(2026, 12, 4, 23, 0), None),
])
def test_a_day_is_cut_at_the_cluster_clock(now, expected):
    assert day_window(RUN_DAY, now) == expected


def row(day: str, utilization, complete=True, **extra) -> dict:
    return {"day": day, "utilization": utilization, "complete": complete, "available_gpu_hours": 96.0,
            "allocated_gpu_hours": 96.0 * (utilization or 0), "by_dag": {"nightly_training": 10.0}, **extra}


@pytest.mark.parametrize("rows, expected", [
    ([row("2026-12-03", 0.1), row("2026-12-04", 0.2), row("2026-12-05", 0.3)], 3),
    ([row("2026-12-03", 0.1), row("2026-12-04", 0.9), row("2026-12-05", 0.3)], 1),  # broken by a good day
    ([row("2026-12-03", 0.1), row("2026-12-05", 0.3)], 1),  # a day without a row proves nothing
    ([row("2026-12-04", 0.1), row("2026-12-05", None)], 0),  # no figure (the partition was down all day)
    ([row("2026-12-04", 0.1), row("2026-12-05", 0.1, complete=False)], 0),  # the day is not over
    ([row("2026-12-05", 0.6)], 0),  # at the target is not under it
    ([], 0),
])
def test_the_under_target_streak(rows, expected):
    assert under_target_streak(rows, RUN_DAY, 0.6) == expected


def test_stored_rows_are_read_back_in_day_order_and_rewritten_by_a_rerun(tmp_path):
    layout = StorageLayout(str(tmp_path))
    for day, utilization in (("2026-12-03", 0.5), ("2026-12-05", 0.2), ("2026-12-04", 0.4)):
        store_day(layout, "gpu-training", date.fromisoformat(day), row(day, utilization))
    store_day(layout, "gpu-training", date(2026, 12, 5), row("2026-12-05", 0.1))  # a rerun replaces the day
    (tmp_path / "utilization/gpu-training/day=2026-12-02.json").write_text("{half a row")  # unreadable: skipped
    rows = read_days(layout, "gpu-training", RUN_DAY, 4)
    assert [(r["day"], r["utilization"]) for r in rows] == [("2026-12-03", 0.5), ("2026-12-04", 0.4),
                                                            ("2026-12-05", 0.1)]
    assert read_days(layout, "another", RUN_DAY) == []
    assert under_target_alerts(layout, ["gpu-training"], RUN_DAY, 0.6, alert_days=3)[0].startswith(
        "GPU partition gpu-training stayed under the 60% utilization target for 3 days (2026-12-03 50.0%")
    assert under_target_alerts(layout, ["gpu-training"], RUN_DAY, 0.45, alert_days=3) == []


def test_the_page_charts_each_partition_and_escapes_what_slurm_reported():
    rows = [row("2026-12-04", 0.25, queue_wait_p50_s=3.0, queue_wait_p95_s=40.0, cpu_efficiency=0.5,
                by_dag={"nightly_training": 20.0, "<script>alert(1)</script>": 4.0}),
            row("2026-12-05", None, complete=False, not_measured={"cpu_efficiency": "no GPU job ended"})]
    page = page_html({"gpu-training": rows, "empty": []}, target=0.6, alert_days=3)
    assert page.count('<svg role="img"') == 4 and page.count('class="target"') == 1
    # utilization (none the second day), GPU-hours by DAG (2 + 1), p50 + p95, CPU efficiency
    assert page.count('class="bar"') == 1 + 3 + 2 + 1
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "2026-12-05 (so far)" in page and "not measured" in page and "no GPU job ended" in page
    assert "No stored days yet" in page  # the partition without rows
    quiet = page_html({"gpu": [row("2026-12-05", 0.2, cpu_efficiency=None)]}, target=0.6, alert_days=3)
    # no empty charts: this day has no queue waits and no CPU efficiency
    assert quiet.count('<svg role="img"') == 2 and quiet.count("Not measured on these days") == 2
    busy = page_html({"gpu": [row("2026-12-05", 0.2, by_dag={f"dag{n}": float(n) for n in range(1, 11)})]}, 0.6, 3)
    # the 7 largest, then the rest as one
    assert "</span> dag10 " in busy and "</span> dag4 " in busy and "</span> dag3 " not in busy
    assert "</span> 3 other DAGs " in busy
    assert "Where training jobs" not in page  # no job wrote a split


def test_the_page_lists_where_training_jobs_time_went_and_the_ledger_reads_fresh_job_figures(tmp_path):
    layout = StorageLayout(str(tmp_path))
    jobs = tmp_path / "utilization/jobs"
    jobs.mkdir(parents=True)
    (jobs / "977.json").write_text('{"job_id": "977", "allocated_s": 40, "shares": {"training_steps": 0.6}, '
                                   '"mean_gpu_utilization_pct": 87.5}')
    (jobs / "978.json").write_text('{"job_id": "978", "mean_gpu_utilization_pct": null}')  # no split, no GPU samples
    (jobs / "979.json").write_text('{"job_id": "979", "mean_gpu_utilization_pct": 250}')  # not a percentage
    (jobs / "12.json").write_text('{"job_id": "12", "shares": {"training_steps": 0.5}}')
    (jobs / "13.json").write_text("not json")
    os.utime(jobs / "12.json", (0, 0))  # written long before the window
    splits, gpu_busy = read_job_figures(layout, datetime(2026, 1, 1))
    assert splits == {"977": {"shares": {"training_steps": 0.6}, "allocated_s": 40}} and gpu_busy == {"977": 0.875}
    rows = [row("2026-12-05", 0.3, time_split_by_job={"977": {"dag_id": "nightly_training",
                                                             "shares": {"training_steps": 0.6, "waiting": 0.4}}})]
    page = page_html({"gpu-training": rows}, target=0.6, alert_days=3)
    assert "<td>977</td><td>nightly_training</td><td>training_steps 60%, waiting 40%</td>" in page


class Sink:
    """Stands in for the on-call notifier (its webhook is a process boundary; its own tests cover it)."""

    def __init__(self) -> None:
        self.alerts = []

    def send(self, alert) -> None:
        self.alerts.append(alert)


class TaskInstance:
    dag_id, run_id, task_id, try_number = "cluster_utilization", "scheduled__2026-12-06", "check_target", 1


def test_on_call_hears_once_the_partition_stayed_under_target_for_alert_days(tmp_path):
    from dataclasses import replace

    from hybridflow.config import pipeline_config
    from hybridflow.pipeline.utilization import alert_low_utilization

    base = pipeline_config()
    config = replace(base, storage=replace(base.storage, root=str(tmp_path)),
                     utilization=replace(base.utilization, partitions=("gpu-training",), target=0.6, alert_days=3))
    layout = config.storage.layout
    for day, utilization in (("2026-12-03", 0.1), ("2026-12-04", 0.2)):
        store_day(layout, "gpu-training", date.fromisoformat(day), row(day, utilization))
    stored = [{"partition": "gpu-training", "day": "2026-12-04", "complete": True}]
    sink = Sink()
    assert alert_low_utilization(config, stored, TaskInstance(), sink) == [] and sink.alerts == []  # 2 days of 3
    store_day(layout, "gpu-training", RUN_DAY, row("2026-12-05", 0.3))
    stored.append({"partition": "gpu-training", "day": "2026-12-05", "complete": True})
    [message] = alert_low_utilization(config, stored, TaskInstance(), sink)
    assert [alert.kind for alert in sink.alerts] == ["low_utilization"] and message in sink.alerts[0].error
    # today so far is never judged: the newest complete day is
    assert alert_low_utilization(config, [{"day": "2026-12-06", "complete": False}], TaskInstance(), sink) == []
