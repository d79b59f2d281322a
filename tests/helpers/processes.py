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
