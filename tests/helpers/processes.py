"""Processes as /proc shows them, for tests that check what a stop or a kill left behind."""

from __future__ import annotations

import time
from pathlib import Path


def live_group_members(group: int) -> list[int]:
    """Live processes of a process group. Killed ones stay zombies until their reaper (PID 1 here, late) collects
    them: those do not count."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def wait_group_gone(group: int, timeout_s: float = 10) -> list[int]:
    """Until no live process of the group is left, or the timeout; what is left (empty when all went)."""
    deadline = time.monotonic() + timeout_s
    while (left := live_group_members(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def rank_pids(job_id: str) -> dict[int, int]:
    """The training processes of a Slurm job by rank, read from /proc (the job runs on this machine)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            variables = (entry / "environ").read_bytes().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in variables if b"=" in item)
        except OSError:
            continue
        if any(arg.endswith(b"train.py") for arg in cmdline) and environ.get(b"SLURM_JOB_ID") == job_id.encode():
            ranks[int(environ[b"SLURM_PROCID"])] = int(entry.name)
    return ranks
