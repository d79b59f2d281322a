"""The GPU partition ledger over days (issue 25): which days a run computes, each day's row stored under the storage
root, the under-target streak on-call hears about, and the UI page's charts (server-drawn SVG, no JavaScript).

One row per partition and calendar day (``utils/ledger.partition_day``, read by ``SlurmHook.ledger_day``). A day
still under way is computed up to now and stored with ``complete: false``; a later run replaces it. Reruns and
backfills rewrite the same file, so they are idempotent.
"""

from __future__ import annotations

import html
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import date, datetime, time, timedelta
from pathlib import Path

from hybridflow.atomic import write_json_atomic
from hybridflow.layout import StorageLayout

MAX_RANGE_DAYS = 92
HISTORY_DAYS = 30
MAX_DAGS_DRAWN = 7
log = logging.getLogger(__name__)


def days_between(first: date, last: date) -> list[date]:
    """Every day from ``first`` to ``last``, both included; a clear error for a reversed or too long range."""
    if last < first:
        raise ValueError(f"end_day {last} is before start_day {first}; give the earlier day as start_day")
    count = (last - first).days + 1
    if count > MAX_RANGE_DAYS:
        raise ValueError(f"{count} days from {first} to {last}; compute at most {MAX_RANGE_DAYS} days per run")
    return [first + timedelta(days=offset) for offset in range(count)]


def day_window(day: date, now: datetime) -> tuple[datetime, datetime] | None:
    """The day's ``[00:00, 24:00)``, cut at ``now`` while the day is under way; None for a day that has not begun."""
    start = datetime.combine(day, time())
    if start >= now:
        return None
    return start, min(start + timedelta(days=1), now)


def store_day(layout: StorageLayout, partition: str, day: date, row: Mapping) -> str:
    path = Path(layout.utilization_day(partition, day.isoformat()))
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o2775)  # shared storage: whoever computes the day next may replace the file
    write_json_atomic(path, {**row, "day": day.isoformat()}, mode=0o664)
    return str(path)


def compute_days(hook, layout: StorageLayout, partitions: Sequence[str], days: Sequence[date],
                 now: datetime) -> list[dict]:
    """Each partition's row for each day (``hook``: a SlurmHook), stored; a day that has not begun is skipped."""
    stored = []
    for partition in partitions:
        for day in days:
            window = day_window(day, now)
            if window is None:
                log.info("%s %s: the day has not begun on the cluster's clock; skipped", partition, day)
                continue
            splits, gpu_busy = read_job_figures(layout, window[0])
            row = {**hook.ledger_day(partition, window, time_splits=splits, gpu_busy=gpu_busy),
                   "complete": window[1] - window[0] == timedelta(days=1)}
            path = store_day(layout, partition, day, row)
            log.info("%s %s%s: %s of %.2f available GPU-hours allocated (%.2f), %d jobs, %.2f GPU-hours outside "
                     "the suite -> %s", partition, day, "" if row["complete"] else " (so far)",
                     _figure(row["utilization"], "%"), row["available_gpu_hours"], row["allocated_gpu_hours"],
                     row["jobs"], row["outside_suite_gpu_hours"], path)
            stored.append({"partition": partition, "day": day.isoformat(), "path": path,
                           **{key: row[key] for key in ("utilization", "available_gpu_hours", "allocated_gpu_hours",
                                                        "complete")}})
    return stored


def under_target_alerts(layout: StorageLayout, partitions: Sequence[str], last: date, target: float,
                        alert_days: int) -> list[str]:
    """One message per partition whose utilization stayed under ``target`` for ``alert_days`` complete days
    ending with ``last``."""
    messages = []
    for partition in partitions:
        rows = read_days(layout, partition, last, alert_days)
        if under_target_streak(rows, last, target) >= alert_days:
            figures = ", ".join(f"{row['day']} {_figure(row.get('utilization'), '%')}" for row in rows)
            messages.append(f"GPU partition {partition} stayed under the {target:.0%} utilization target for "
                            f"{alert_days} days ({figures}). Runbook: include/runbooks/utilization.md")
    return messages


def read_job_figures(layout: StorageLayout, since: datetime) -> tuple[dict[str, dict], dict[str, float]]:
    """What training jobs left for the ledger (operators/training.py) since ``since``, by job id: their time splits,
    and their GPUs' measured mean utilization (0-1) where nvidia-smi sampled them."""
    splits, gpu_busy = {}, {}
    for path in Path(layout.utilization_jobs).glob("*.json"):
        try:
            if datetime.fromtimestamp(path.stat().st_mtime) < since:
                continue
            figures = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(figures, dict):
            continue
        if isinstance(figures.get("shares"), dict):
            splits[path.stem] = {"shares": figures["shares"], "allocated_s": figures.get("allocated_s")}
        busy = figures.get("mean_gpu_utilization_pct")
        if isinstance(busy, int | float) and not isinstance(busy, bool) and 0 <= busy <= 100:
            gpu_busy[path.stem] = busy / 100
    return splits, gpu_busy


def read_days(layout: StorageLayout, partition: str, last: date, count: int = HISTORY_DAYS) -> list[dict]:
    """The stored rows of the ``count`` days ending with ``last``, oldest first; a day without a row is absent (an
    unreadable one too: the page and the alert use what exists)."""
    rows = []
    for offset in range(count - 1, -1, -1):
        day = (last - timedelta(days=offset)).isoformat()
        try:
            row = json.loads(Path(layout.utilization_day(partition, day)).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(row, dict) and row.get("day") == day:
            rows.append(row)
    return rows


def under_target_streak(rows: Sequence[Mapping], last: date, target: float) -> int:
    """How many complete days up to ``last``, without a gap, the partition's utilization stayed under ``target``
    (a day without a row, or without a figure, ends the streak: it proves nothing)."""
    by_day = {row.get("day"): row for row in rows}
    streak, day = 0, last
    while (row := by_day.get(day.isoformat())) is not None:
        utilization = row.get("utilization")
        if not row.get("complete") or not isinstance(utilization, int | float) or utilization >= target:
            break
        streak += 1
        day -= timedelta(days=1)
    return streak


# --- the page ------------------------------------------------------------------------------------------------

_WIDTH, _HEIGHT, _LEFT, _BOTTOM, _TOP = 720, 220, 48, 28, 12
_COLOURS = ("#3b6fb6", "#e08a2c", "#4c9f50", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")


def _chart(title: str, days: Sequence[str], series: Mapping[str, Sequence[float | None]], *, unit: str,
           stacked: bool = False, line: float | None = None, line_label: str = "") -> str:
    """One bar chart as inline SVG: a bar per day (grouped per series, or stacked), a labelled y axis, an
    optional horizontal line (the target). Days with no figure draw no bar."""
    if all(value is None for values in series.values() for value in values):
        return (f'<figure><figcaption>{html.escape(title)}</figcaption><p class="not-measured">Not measured on '
                f'these days (the table says why).</p></figure>')
    totals = [sum(v or 0 for v in values) for values in zip(*series.values(), strict=True)] if stacked else [
        max((v or 0 for v in values), default=0) for values in zip(*series.values(), strict=True)]
    top = max([*totals, line or 0, 1e-9]) * 1.1
    plot_w, plot_h = _WIDTH - _LEFT - 8, _HEIGHT - _BOTTOM - _TOP
    slots = max(len(days), HISTORY_DAYS)  # a day keeps its width however few are stored; the newest on the right
    slot, first = plot_w / slots, slots - len(days)

    def y(value: float) -> float:
        return _TOP + plot_h * (1 - value / top)

    parts = [f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_WIDTH - 8}" y2="{_TOP + plot_h}" stroke="#444"/>',
             f'<text x="4" y="{_TOP + 10}" font-size="11">{top:.3g} {html.escape(unit)}</text>',
             f'<text x="4" y="{_TOP + plot_h}" font-size="11">0</text>']
    for index, day in enumerate(days):
        x0, base = _LEFT + (first + index) * slot, 0.0
        width = slot * 0.8 / (1 if stacked else max(len(series), 1))
        for number, (name, values) in enumerate(series.items()):
            value = values[index]
            if value is None:
                continue
            x = x0 + slot * 0.1 + (0 if stacked else number * width)
            low = base if stacked else 0.0
            colour = _COLOURS[number % len(_COLOURS)]
            tip = f"{day} {name}: {value:.4g} {unit}"
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{y(low + value):.1f}" width="{width:.1f}" '
                         f'height="{max(y(low) - y(low + value), 0):.1f}" fill="{colour}">'
                         f'<title>{html.escape(tip)}</title></rect>')
            base += value if stacked else 0
        if index % max(len(days) // 10, 1) == 0:
            parts.append(f'<text x="{x0 + 2:.1f}" y="{_HEIGHT - 8}" font-size="10">{html.escape(day[5:])}</text>')
    if line is not None:
        parts.append(f'<line class="target" x1="{_LEFT}" y1="{y(line):.1f}" x2="{_WIDTH - 8}" y2="{y(line):.1f}" '
                     f'stroke="#c00" stroke-dasharray="6 4"/><text x="{_WIDTH - 140}" y="{y(line) - 4:.1f}" '
                     f'font-size="11" fill="#c00">{html.escape(line_label)}</text>')
    legend = "".join(f'<span style="color:{_COLOURS[n % len(_COLOURS)]}">&#9632;</span> {html.escape(name)} '
                     for n, name in enumerate(series))
    return (f'<figure><figcaption>{html.escape(title)}</figcaption><svg role="img" aria-label="{html.escape(title)}"'
            f' width="{_WIDTH}" height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}">{"".join(parts)}</svg>'
            f'<div class="legend">{legend}</div></figure>')


def _figure(value, unit: str = "") -> str:
    if not isinstance(value, int | float):
        return "not measured"
    return f"{value:.1%}" if unit == "%" else f"{value:.4g}{unit}"


def partition_section(partition: str, rows: Sequence[Mapping], target: float) -> str:
    """The charts and the table of one partition's stored days (oldest first)."""
    title = f"Partition {partition}"
    if not rows:
        return (f"<section><h2>{html.escape(title)}</h2><p>No stored days yet: trigger the cluster_utilization "
                f"DAG (a date range from its trigger form fills past days).</p></section>")
    days = [row["day"] for row in rows]
    dags = sorted({name for row in rows for name in row.get("by_dag", {})},
                  key=lambda name: -sum(row.get("by_dag", {}).get(name, 0) for row in rows))
    by_dag = {name: [row.get("by_dag", {}).get(name) for row in rows] for name in dags[:MAX_DAGS_DRAWN]}
    if len(dags) > MAX_DAGS_DRAWN:  # the rest as one bar: a chart of 40 colours reads as none
        by_dag[f"{len(dags) - MAX_DAGS_DRAWN} other DAGs"] = [
            sum(row.get("by_dag", {}).get(name, 0) for name in dags[MAX_DAGS_DRAWN:]) or None for row in rows]
    charts = [
        _chart("Utilization per day (allocated / available GPU-hours)", days,
               {"utilization": [row.get("utilization") for row in rows]}, unit="", line=target,
               line_label=f"target {target:.0%}"),
        _chart("GPU-hours by DAG", days, by_dag or {"none": [0.0] * len(rows)}, unit="GPU-h", stacked=True),
        _chart("Queue wait of GPU jobs (p50, p95)", days,
               {"p50": [row.get("queue_wait_p50_s") for row in rows],
                "p95": [row.get("queue_wait_p95_s") for row in rows]}, unit="s"),
        _chart("CPU efficiency of GPU jobs", days, {"CPU efficiency": [row.get("cpu_efficiency") for row in rows]},
               unit=""),
    ]
    header = ("<tr><th>Day</th><th>Utilization</th><th>Available GPU-h</th><th>Allocated GPU-h</th><th>Idle GPU-h"
              "</th><th>Down GPU-h</th><th>Jobs</th><th>Outside the suite GPU-h</th><th>Not measured</th></tr>")
    body = "".join(
        f"<tr><td>{html.escape(row['day'])}{'' if row.get('complete') else ' (so far)'}</td>"
        f"<td>{_figure(row.get('utilization'), '%')}</td><td>{_figure(row.get('available_gpu_hours'))}</td>"
        f"<td>{_figure(row.get('allocated_gpu_hours'))}</td><td>{_figure(row.get('idle_gpu_hours'))}</td>"
        f"<td>{_figure(row.get('down_gpu_hours'))}</td><td>{_figure(row.get('jobs'))}</td>"
        f"<td>{_figure(row.get('outside_suite_gpu_hours'))}</td>"
        f"<td>{html.escape('; '.join(f'{k}: {v}' for k, v in (row.get('not_measured') or {}).items()))}</td></tr>"
        for row in reversed(rows))
    return (f"<section><h2>{html.escape(title)}</h2>{''.join(charts)}<table class=\"days\">{header}{body}</table>"
            f"{_time_split_table(rows)}</section>")


def _time_split_table(rows: Sequence[Mapping], limit: int = 10) -> str:
    """Where the newest training jobs' allocated time went (the jobs that wrote a split)."""
    jobs = [(row["day"], job_id, split) for row in rows
            for job_id, split in sorted((row.get("time_split_by_job") or {}).items())]
    if not jobs:
        return ""
    body = "".join(
        f"<tr><td>{html.escape(day)}</td><td>{html.escape(job_id)}</td><td>{html.escape(str(split.get('dag_id')))}"
        f"</td><td>{html.escape(', '.join(f'{name} {share:.0%}' for name, share in split['shares'].items()))}</td>"
        f"</tr>" for day, job_id, split in reversed(jobs[-limit:]))
    return ("<h3>Where training jobs' time went (shares of the job's allocated time)</h3><table class=\"splits\">"
            f"<tr><th>Day</th><th>Slurm job</th><th>DAG</th><th>Split</th></tr>{body}</table>")


def page_html(sections: Mapping[str, Sequence[Mapping]], target: float, alert_days: int) -> str:
    style = ("body{font-family:sans-serif;margin:1.5em}figure{margin:1em 0}figcaption{font-weight:bold}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}")
    intro = (f"<p>The last {HISTORY_DAYS} days of each GPU partition from Slurm's accounting: target "
             f"{target:.0%} utilization (pipeline.yaml utilization.target); on-call is alerted after "
             f"{alert_days} complete days under it.</p>")
    body = "".join(partition_section(name, rows, target) for name, rows in sections.items())
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>GPU utilization</title><style>{style}"
            f"</style></head><body><h1>GPU utilization</h1>{intro}{body}</body></html>")


# --- the DAG's tasks ------------------------------------------------------------------------------------------

def days_from_params(params: Mapping, run_day: date) -> list[date]:
    """The days a run computes: ``start_day``..``end_day`` from the trigger form, else the day before the run
    (complete: the scheduled run after midnight is for it) and the run's own day so far."""
    def parse(name: str, fallback: date) -> date:
        value = params.get(name) or ""
        if not value:
            return fallback
        try:
            return date.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not a calendar day; give YYYY-MM-DD") from None

    if not params.get("start_day"):
        return days_between(run_day - timedelta(days=1), parse("end_day", run_day))
    first = parse("start_day", run_day)
    return days_between(first, parse("end_day", first))


def run_ledger(config, params: Mapping, run_after: datetime) -> list[dict]:
    """The ``ledger`` task: every configured partition's rows for the run's days, stored. Refused before Slurm is
    asked when the days are not valid."""
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.hooks.slurm import SlurmHook
    from hybridflow.utils.reconcile import CLUSTER_CLOCK_ARGV, parse_cluster_clock

    try:
        days = days_from_params(params, run_after.date())
    except ValueError as error:
        raise AirflowFailException(f"{error}. Nothing was computed.") from None
    hook = SlurmHook(config.cluster.ssh_conn_id)
    try:
        now = datetime.fromtimestamp(parse_cluster_clock(hook.run(list(CLUSTER_CLOCK_ARGV)).stdout))  # its clock
        return compute_days(hook, config.storage.layout, config.utilization.partitions, days, now)
    finally:
        hook.close()


def alert_low_utilization(config, stored: Sequence[Mapping], ti, notifier) -> list[str]:
    """The ``check_target`` task: on-call hears about each partition under the target for ``alert_days`` complete
    days ending with the newest complete day this run computed (none: nothing to judge)."""
    from hybridflow.notifiers.oncall import LOW_UTILIZATION, build_alert

    complete = [date.fromisoformat(row["day"]) for row in stored if row.get("complete")]
    if not complete:
        log.info("no complete day computed: nothing to judge against the target")
        return []
    target = config.utilization
    messages = under_target_alerts(config.storage.layout, target.partitions, max(complete), target.target,
                                   target.alert_days)
    for message in messages:
        log.warning("%s", message)
        notifier.send(build_alert(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, try_number=ti.try_number,
                                  error=message, kind=LOW_UTILIZATION, log_lines=config.alerts.log_lines))
    return messages
