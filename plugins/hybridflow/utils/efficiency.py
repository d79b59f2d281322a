"""A Slurm job's efficiency from its accounting (issue 25): pure functions over ``sacct`` text, standard library only.

One ``sacct -D`` of the job lists every run of it (a requeued job runs again under the same id), each followed by
its steps. From that: how long it queued, how much of its time limit it used, how well it used the CPUs and memory
it asked for, the GPU-hours it held, and what its requeues cost. A figure Slurm does not have is ``None`` with the
reason in ``not_measured``, never a made-up zero: a cluster with ``JobAcctGatherType=jobacct_gather/none`` (the
default) records no per-step CPU time or memory at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from hybridflow.exceptions import SlurmOutputParseError
from hybridflow.utils.slurm import _gpus_from_tres, _parse_duration, _parse_int, _parse_timestamp, _parse_tres

# sacct -j <id> -D -P -n --format=<EFFICIENCY_FORMAT>   (-D: every run of a requeued job; steps follow their run)
EFFICIENCY_FORMAT = "JobID,State,Submit,Start,End,ElapsedRaw,TimelimitRaw,TotalCPU,AllocCPUS,MaxRSS,ReqMem,AllocTRES"
_FIELDS = EFFICIENCY_FORMAT.split(",")
# How a run ended when the job ran again afterwards: its time is lost work (up to its last checkpoint).
RERUN_STATES = frozenset({"REQUEUED", "NODE_FAIL", "PREEMPTED"})
UNSETTLED_STATES = frozenset({"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"})
NO_GATHERING = ("the cluster records no per-step usage (JobAcctGatherType=jobacct_gather/none); set "
                "jobacct_gather/linux or cgroup in slurm.conf")
NO_MEMORY_SAMPLE = ("no memory sample: the job's steps ended before Slurm's first usage sample "
                    "(JobAcctGatherFrequency in slurm.conf)")
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[KMGTP]?)[nc]?")
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def efficiency_argv(job_id: str) -> list[str]:
    return ["sacct", "-j", job_id, "-D", "-P", "-n", f"--format={EFFICIENCY_FORMAT}"]


@dataclass
class _Run:
    state: str
    submit: datetime | None
    start: datetime | None
    elapsed_s: int
    time_limit_s: int | None
    total_cpu_s: float
    cpus: int
    requested_mem: int | None
    gpus: int
    steps_max_rss: list[int | None] = field(default_factory=list)  # bytes, None where not recorded


def _size(text: str, what: str) -> int | None:
    """Bytes of a sacct size such as ``123456K``, ``1.5G`` or ``40000M`` (``n``/``c`` suffixes of old versions
    dropped); None when empty."""
    if not text.strip() or text.strip() == "0":
        return None
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise SlurmOutputParseError(f"{what} is not a size: {text!r}")
    return int(float(match.group("number")) * _UNIT[match.group("unit")])


def _runs(sacct_text: str, job_id: str) -> list[_Run]:
    runs: list[_Run] = []
    for line in filter(str.strip, sacct_text.splitlines()):
        values = line.split("|")
        if len(values) != len(_FIELDS):
            raise SlurmOutputParseError(f"expected {len(_FIELDS)} '|'-separated fields ({EFFICIENCY_FORMAT}): {line!r}")
        row = dict(zip(_FIELDS, values, strict=True))
        if row["JobID"] == job_id:
            limit = row["TimelimitRaw"].strip()
            runs.append(_Run(
                state=row["State"].split()[0], submit=_parse_timestamp(row["Submit"]),
                start=_parse_timestamp(row["Start"]), elapsed_s=_parse_int(row["ElapsedRaw"], "ElapsedRaw"),
                time_limit_s=int(limit) * 60 if limit.isdigit() else None,
                total_cpu_s=_parse_duration(row["TotalCPU"]) if row["TotalCPU"].strip() else 0.0,
                cpus=_parse_int(row["AllocCPUS"], "AllocCPUS"), requested_mem=_size(row["ReqMem"], "ReqMem"),
                gpus=_gpus_from_tres(_parse_tres(row["AllocTRES"], line), line)))
        elif row["JobID"].startswith(f"{job_id}.") and runs:
            runs[-1].steps_max_rss.append(_size(row["MaxRSS"], "MaxRSS"))
    return runs


def accounting_settled(sacct_text: str, job_id: str) -> bool:
    """Whether accounting holds the job's end: its last run has an end time and a final state."""
    lines = [line.split("|") for line in sacct_text.splitlines() if line.split("|", 1)[0] == job_id]
    if not lines or len(lines[-1]) != len(_FIELDS):
        return False
    last = dict(zip(_FIELDS, lines[-1], strict=True))
    return last["End"] not in ("", "Unknown", "None") and last["State"].split(" ")[0] not in UNSETTLED_STATES


def job_efficiency(sacct_text: str, job_id: str) -> dict:
    """The efficiency figures of job ``job_id`` from ``sacct`` (:func:`efficiency_argv`) after it ended."""
    runs = [run for run in _runs(sacct_text, job_id) if run.start is not None]
    if not runs:
        return {"job_id": job_id, "runs": 0, "not_measured": {"all": "the job never started"}}
    first, last = runs[0], runs[-1]
    elapsed = sum(run.elapsed_s for run in runs)
    lost = sum(run.elapsed_s for run in runs if run.state in RERUN_STATES)
    not_measured: dict[str, str] = {}
    sampled = any(rss is not None for run in runs for rss in run.steps_max_rss)
    cpu_used = sum(run.total_cpu_s for run in runs)
    cpu_seconds = sum(run.cpus * run.elapsed_s for run in runs)
    cpu_efficiency = None
    if not sampled and not cpu_used:
        not_measured["cpu_efficiency"] = not_measured["max_rss_gib"] = NO_GATHERING
    else:
        if cpu_seconds:
            cpu_efficiency = round(cpu_used / cpu_seconds, 4)
        else:
            not_measured["cpu_efficiency"] = "the job ran for under a second"
        if not sampled:
            not_measured["max_rss_gib"] = NO_MEMORY_SAMPLE
    max_rss = max((rss or 0 for run in runs for rss in run.steps_max_rss), default=0) if sampled else None
    if last.requested_mem is None:
        not_measured["requested_mem_gib"] = "the job asked for no memory (the partition's default applied)"
    if last.time_limit_s is None:
        not_measured["time_limit_share"] = "the job had no time limit"
    queued = (first.start - first.submit).total_seconds() if first.submit else None
    return {
        "job_id": job_id,
        "runs": len(runs),
        "requeues": len(runs) - 1,
        "queue_wait_s": None if queued is None else max(queued, 0.0),
        "elapsed_s": elapsed,
        "lost_to_requeues_s": lost,
        "time_limit_s": last.time_limit_s,
        "time_limit_share": round(last.elapsed_s / last.time_limit_s, 4) if last.time_limit_s else None,
        "cpus": last.cpus,
        "cpu_efficiency": cpu_efficiency,
        "max_rss_gib": None if max_rss is None else round(max_rss / (1 << 30), 3),
        "requested_mem_gib": None if last.requested_mem is None else round(last.requested_mem / (1 << 30), 3),
        "gpus": last.gpus,
        "gpu_hours_allocated": round(sum(run.gpus * run.elapsed_s for run in runs) / 3600, 4),
        "not_measured": not_measured,
    }


def describe_efficiency(figures: Mapping) -> str:
    """One line for the task log: ``queued 3 s, ran 20 s (6% of its limit), CPU 41%, ...``."""
    if not figures.get("runs"):
        return figures.get("not_measured", {}).get("all", "never started")
    parts = [f"queued {figures['queue_wait_s']:.0f} s" if figures.get("queue_wait_s") is not None else None,
             f"ran {figures['elapsed_s']} s" + (f" ({figures['time_limit_share']:.0%} of its limit)"
                                                if figures.get("time_limit_share") is not None else ""),
             f"CPU efficiency {figures['cpu_efficiency']:.0%}" if figures.get("cpu_efficiency") is not None else None,
             f"max RSS {figures['max_rss_gib']} GiB" if figures.get("max_rss_gib") is not None else None,
             f"{figures['gpu_hours_allocated']} GPU-hours" if figures.get("gpus") else None,
             f"{figures['requeues']} requeue(s), {figures['lost_to_requeues_s']} s lost"
             if figures["requeues"] else None]
    measured = ", ".join(part for part in parts if part)
    missing = "; ".join(f"{key} not measured: {why}" for key, why in figures.get("not_measured", {}).items())
    return f"{measured}{f' ({missing})' if missing else ''}"


# the categories a training job reports (jobs/hybridtrain/time_split.py), in the order people read them
TIME_SPLIT_ORDER = ("training_steps", "data_loading", "rendezvous", "checkpoint_writes", "checkpoint_reads",
                    "evaluation", "startup", "export")


def time_shares(split_s: Mapping | None, allocated_s: float | None) -> dict | None:
    """Rank 0's seconds per phase (``metrics.json`` ``time_split_s``) as shares of the job's allocated time
    (Slurm's elapsed of this run); ``waiting`` is the rest: Slurm's launch, the node self-check, process start and
    teardown, time outside rank 0's phases. None when the job wrote no split or the elapsed time is unknown."""
    if not isinstance(split_s, Mapping) or not split_s or not allocated_s or allocated_s <= 0:
        return None
    seconds = {name: float(value) for name, value in split_s.items()
               if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0}
    ordered = [name for name in TIME_SPLIT_ORDER if name in seconds] + sorted(set(seconds) - set(TIME_SPLIT_ORDER))
    shares = {name: round(seconds[name] / allocated_s, 4) for name in ordered}
    shares["waiting"] = round(max(allocated_s - sum(seconds.values()), 0.0) / allocated_s, 4)
    return {"allocated_s": allocated_s, "seconds": {name: round(seconds[name], 3) for name in ordered},
            "shares": shares}


def describe_time_shares(split: Mapping | None) -> str | None:
    """``training steps 61%, data loading 9%, ..., waiting 12%`` (shares of 1% or more)."""
    if not split:
        return None
    return ", ".join(f"{name.replace('_', ' ')} {share:.0%}" for name, share in split["shares"].items()
                     if share >= 0.01) or None
