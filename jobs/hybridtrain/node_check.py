"""A node's self-check before the ranks of a training job start on it: one process per node, as an ``srun`` step
of the batch script; the job ends with :data:`NODE_CHECK_FAILED` (the operator's failure class
``unhealthy_node``) when one check fails, and the operator submits once more without that node.

Checks: the GPUs visible match the GRES allocation (where ``nvidia-smi`` exists), free space on the checkpoint
filesystem, node-local scratch writable with free space (where configured; ``%n`` is the node's name), and
MASTER_ADDR resolves and has a route. Each prints one line; a failure reads
``NODE CHECK FAILED on <node>: <check>: <what is wrong>``, the line the operator and the alert read.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NODE_CHECK_FAILED", "Check", "check_node", "failure_line"]

NODE_CHECK_FAILED = 79  # the job's exit code; include/config/pipeline.yaml failure class unhealthy_node
GIB = 1024**3


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def failure_line(node: str, check: Check) -> str:
    return f"NODE CHECK FAILED on {node}: {check.name}: {check.detail}"


def gpus_visible(expected: int, nvidia_smi: str | None, run: Callable[[list[str]], str]) -> Check:
    """``nvidia-smi -L`` lists as many GPUs as Slurm allocated on this node (the step holds the node's GRES)."""
    if expected == 0:
        return Check("gpus", True, "no GPU allocated")
    if nvidia_smi is None:
        return Check("gpus", True, "not checked: no nvidia-smi on this node")
    try:
        listing = run([nvidia_smi, "-L"])
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("gpus", False, f"nvidia-smi failed: {exc}")
    seen = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    if seen != expected:
        return Check("gpus", False, f"{seen} GPU(s) visible, {expected} allocated (a GPU fell off the bus?)")
    return Check("gpus", True, f"{seen} GPU(s) visible")


def free_space(name: str, path: Path, min_free_gib: float, *, probe: bool) -> Check:
    """``path`` exists, is writable (``probe``: a file is created and removed) and has ``min_free_gib`` free."""
    try:
        free = shutil.disk_usage(path).free / GIB
        if probe:
            marker = path / f".node-check-{uuid.uuid4().hex}"
            marker.write_bytes(b"")
            marker.unlink()
        elif not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"{path} is not writable by this user")
    except OSError as exc:
        return Check(name, False, f"{path}: {exc.strerror or exc}")
    if free < min_free_gib:
        return Check(name, False, f"{path}: {free:.1f} GiB free, below {min_free_gib:g} GiB")
    return Check(name, True, f"{path}: {free:.1f} GiB free")


def master_reachable(master: str | None) -> Check:
    """MASTER_ADDR resolves and this node has a route to it (a UDP connect sends nothing)."""
    if not master:
        return Check("master", True, "not checked: no MASTER_ADDR (one node)")
    try:
        address = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)[0][4][0]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
    except OSError as exc:
        return Check("master", False, f"MASTER_ADDR {master} does not resolve or has no route: {exc}")
    return Check("master", True, f"MASTER_ADDR {master} -> {address}")


def check_node(*, node: str, gpus: int, checkpoint_dir: Path, min_free_gib: float, scratch_dir: str,
               master: str | None, environ: Mapping[str, str] = os.environ) -> list[Check]:
    def run(argv: list[str]) -> str:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout

    checks = [gpus_visible(gpus, shutil.which("nvidia-smi", path=environ.get("PATH")), run),
              free_space("checkpoint filesystem", checkpoint_dir, min_free_gib, probe=False)]
    if scratch_dir:
        checks.append(free_space("scratch", Path(scratch_dir.replace("%n", node)), min_free_gib, probe=True))
    checks.append(master_reachable(master))
    return checks
