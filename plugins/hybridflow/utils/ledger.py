"""The GPU partition ledger (issue 25): how well a partition's GPUs were used on one day, and by whom.

Pure functions over what Slurm prints, standard library only; the hook runs the commands. For one partition and
one day (the window ``[start, end)``):

- available GPU-hours: every node's GPUs x the window, less the time Slurm's node events say it was down or
  drained (``sacctmgr show event``; overlapping events of a node counted once);
- allocated GPU-hours: every job's GPUs x the part of its run inside the window (``sacct -a -D``: each run of a
  requeued job counts; a job still running counts up to the window's end);
- utilization = allocated / available, idle = available - allocated;
- the allocated hours split by DAG and by task (the job comment's key, :class:`SlurmJobKey`), by user, and the
  hours of jobs that are not the suite's;
- measured busy GPU-hours where a job's GPU samples exist (its mean utilization x its hours), else not measured;
- the queue wait (submit -> start) p50/p95 of the GPU runs that started in the window, and the CPU efficiency of the
  GPU jobs that ended in it (TotalCPU / (AllocCPUS x Elapsed); not measured where the cluster gathers no usage).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.efficiency import NO_GATHERING
from hybridflow.utils.latency import percentile
from hybridflow.utils.slurm import _gpus_from_tres, _parse_duration, _parse_int, _parse_timestamp, _parse_tres
from hybridflow.utils.slurm_jobs import SlurmJobKey

# sacct -a -D -P -n -r <partition> -S <start> -E <end> --format=<LEDGER_JOBS_FORMAT>   (no -X: with it, a job's
# TotalCPU is 0 rather than the sum of its steps; the step lines are skipped)
LEDGER_JOBS_FORMAT = "JobID,User,Partition,State,Submit,Start,End,ElapsedRaw,TotalCPU,AllocCPUS,AllocTRES,Comment"
# sacctmgr -P -n show event Start=<start> End=<end> Nodes=<nodes> format=<NODE_EVENTS_FORMAT>
NODE_EVENTS_FORMAT = "NodeName,TimeStart,TimeEnd,State,Reason"
OUTSIDE_SUITE = "(not the suite's)"


def ledger_jobs_argv(partition: str, start: datetime, end: datetime) -> list[str]:
    return ["sacct", "-a", "-D", "-P", "-n", "-r", partition, "-S", start.isoformat(timespec="seconds"),
            "-E", end.isoformat(timespec="seconds"), f"--format={LEDGER_JOBS_FORMAT}"]


def node_events_argv(nodes: Iterable[str], start: datetime, end: datetime) -> list[str]:
    return ["sacctmgr", "-P", "-n", "show", "event", f"Start={start.isoformat(timespec='seconds')}",
            f"End={end.isoformat(timespec='seconds')}", f"Nodes={','.join(nodes)}", f"format={NODE_EVENTS_FORMAT}"]


@dataclass(frozen=True)
class LedgerJob:
    job_id: str
    user: str
    gpus: int
    start: datetime
    end: datetime | None  # None: still running
    key: SlurmJobKey | None
    submit: datetime | None = None
    elapsed_s: int = 0
    total_cpu_s: float = 0.0
    cpus: int = 0


def parse_ledger_jobs(stdout: str) -> list[LedgerJob]:
    """Every run that started, from ``ledger_jobs_argv``'s output (the comment may hold '|': it is the last field)."""
    jobs = []
    for line in filter(str.strip, stdout.splitlines()):
        fields = line.split("|", len(LEDGER_JOBS_FORMAT.split(",")) - 1)
        if len(fields) != len(LEDGER_JOBS_FORMAT.split(",")):
            raise SlurmOutputParseError(f"expected the fields {LEDGER_JOBS_FORMAT}: {line!r}")
        job_id, user, _partition, _state, submit, start, end, elapsed, total_cpu, cpus, tres, comment = fields
        if "." in job_id:
            continue  # a step (batch, extern, srun): its job's line holds the totals
        started = _parse_timestamp(start)
        if started is None:
            continue
        jobs.append(LedgerJob(
            job_id=job_id, user=user, gpus=_gpus_from_tres(_parse_tres(tres, line), line), start=started,
            end=_parse_timestamp(end), key=SlurmJobKey.from_comment(comment), submit=_parse_timestamp(submit),
            elapsed_s=_parse_int(elapsed, "ElapsedRaw"),
            total_cpu_s=_parse_duration(total_cpu) if total_cpu.strip() else 0.0, cpus=_parse_int(cpus, "AllocCPUS")))
    return jobs


def parse_node_events(stdout: str) -> list[tuple[str, datetime, datetime | None]]:
    """(node, down from, down until or None while it lasts) for each node event (cluster events have no node)."""
    events = []
    for line in filter(str.strip, stdout.splitlines()):
        fields = line.split("|", 4)
        if len(fields) != 5:
            raise SlurmOutputParseError(f"expected the fields {NODE_EVENTS_FORMAT}: {line!r}")
        node, began, ended = fields[0].strip(), _parse_timestamp(fields[1]), _parse_timestamp(fields[2])
        if node and began is not None:
            events.append((node, began, ended))
    return events


def _overlap(start: datetime, end: datetime | None, window: tuple[datetime, datetime]) -> float:
    """Seconds of ``[start, end)`` inside the window (an open end lasts to the window's end)."""
    stop = min(end or window[1], window[1])
    return max((stop - max(start, window[0])).total_seconds(), 0.0)


def _down_seconds(events: list[tuple[datetime, datetime | None]], window: tuple[datetime, datetime]) -> float:
    """Seconds of the window covered by any of one node's events, overlapping events merged."""
    clipped = sorted((max(began, window[0]), min(ended or window[1], window[1])) for began, ended in events)
    total, reach = 0.0, window[0]
    for began, ended in clipped:
        began = max(began, reach)
        if ended > began:
            total += (ended - began).total_seconds()
            reach = ended
    return total


def partition_day(partition: str, window: tuple[datetime, datetime], node_gpus: Mapping[str, int],
                  jobs: Iterable[LedgerJob], node_events: Iterable[tuple[str, datetime, datetime | None]],
                  gpu_busy: Mapping[str, float] | None = None,
                  time_splits: Mapping[str, Mapping] | None = None) -> dict:
    """The ledger row of one partition for ``window``. ``node_gpus``: node -> its GPUs (GRES); ``gpu_busy``: job id
    -> mean GPU utilization (0-1) measured by the job, where it was; ``time_splits``: job id -> where a training
    job's time went (``efficiency.time_shares``), kept for the jobs of the window."""
    hours = (window[1] - window[0]).total_seconds() / 3600
    by_node: dict[str, list] = defaultdict(list)
    for node, began, ended in node_events:
        if node in node_gpus:
            by_node[node].append((began, ended))
    down = sum(node_gpus[node] * _down_seconds(events, window) for node, events in by_node.items()) / 3600
    available = sum(node_gpus.values()) * hours - down
    by_dag: dict[str, float] = defaultdict(float)
    by_task: dict[str, float] = defaultdict(float)
    by_user: dict[str, float] = defaultdict(float)
    allocated, busy, measured, counted = 0.0, 0.0, 0.0, 0
    waits: list[float] = []
    split_by_job: dict[str, dict] = {}
    cpu_used, cpu_held = 0.0, 0.0
    for job in jobs:
        gpu_hours = job.gpus * _overlap(job.start, job.end, window) / 3600
        if gpu_hours <= 0:
            continue
        if job.submit is not None and window[0] <= job.start < window[1]:
            waits.append(max((job.start - job.submit).total_seconds(), 0.0))
        if job.end is not None and window[0] <= job.end < window[1]:
            cpu_used += job.total_cpu_s
            cpu_held += job.cpus * job.elapsed_s
        counted += 1
        if time_splits and job.job_id in time_splits:
            split_by_job[job.job_id] = {"dag_id": job.key.dag_id if job.key else None, **time_splits[job.job_id]}
        allocated += gpu_hours
        by_user[job.user] += gpu_hours
        dag = job.key.dag_id if job.key else OUTSIDE_SUITE
        by_dag[dag] += gpu_hours
        by_task[f"{job.key.dag_id}.{job.key.task_id}" if job.key else OUTSIDE_SUITE] += gpu_hours
        if gpu_busy and job.job_id in gpu_busy:
            busy += gpu_busy[job.job_id] * gpu_hours
            measured += gpu_hours
    not_measured = {}
    cpu_efficiency = round(cpu_used / cpu_held, 4) if cpu_used > 0 and cpu_held > 0 else None
    if cpu_efficiency is None:
        not_measured["cpu_efficiency"] = NO_GATHERING if cpu_held > 0 else "no GPU job ended in the window"
    if not waits:
        not_measured["queue_wait"] = "no GPU job started in the window"
    if measured < allocated:
        not_measured["busy_gpu_hours"] = (f"{allocated - measured:.2f} of {allocated:.2f} allocated GPU-hours had no "
                                          "GPU samples (no nvidia-smi where they ran)")

    def rounded(split: Mapping[str, float]) -> dict[str, float]:
        return {name: round(value, 4) for name, value in sorted(split.items(), key=lambda item: -item[1])}

    return {
        "partition": partition,
        "start": window[0].isoformat(), "end": window[1].isoformat(),
        "gpus": sum(node_gpus.values()),
        "available_gpu_hours": round(available, 4),
        "down_gpu_hours": round(down, 4),
        "allocated_gpu_hours": round(allocated, 4),
        "utilization": round(allocated / available, 4) if available > 0 else None,
        "idle_gpu_hours": round(max(available - allocated, 0.0), 4),
        "busy_gpu_hours": round(busy, 4) if measured else None,
        "measured_gpu_hours": round(measured, 4),
        "jobs": counted,
        "queue_wait_p50_s": percentile(waits, 50) if waits else None,
        "queue_wait_p95_s": percentile(waits, 95) if waits else None,
        "cpu_efficiency": cpu_efficiency,
        "by_dag": rounded(by_dag), "by_task": rounded(by_task), "by_user": rounded(by_user),
        "outside_suite_gpu_hours": round(by_dag.get(OUTSIDE_SUITE, 0.0), 4),
        "time_split_by_job": split_by_job,
        "not_measured": not_measured,
    }
