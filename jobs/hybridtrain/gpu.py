"""GPU utilization sampling inside the training job: ``nvidia-smi`` every few seconds into a JSON-lines file.

Each line of ``<run_dir>/gpu_metrics.jsonl`` is one sample of every GPU ``nvidia-smi`` shows on the node::

    {"ts": "...", "host": "gpu-node-01", "gpu_available": true,
     "gpus": [{"index": 0, "utilization_pct": 87.0, "memory_used_mib": 30512.0, "power_w": 412.3}]}

Where ``nvidia-smi`` does not exist, one line says so (``{"gpu_available": false, "reason": "nvidia-smi not
found", ...}``) and nothing else is written: numbers are never invented. A value ``nvidia-smi`` reports as
``[N/A]`` is null. Under Slurm with device cgroups (``ConstrainDevices=yes``) ``nvidia-smi`` shows only the
job's GPUs; without them it shows every GPU of the node. Restarts of a run append to the same file.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "NVIDIA_SMI_QUERY",
    "GpuSampler",
    "nvidia_smi_command",
    "parse_nvidia_smi_csv",
    "read_gpu_metrics",
    "summarise_gpu_metrics",
]

NVIDIA_SMI_QUERY = ("utilization.gpu", "memory.used", "power.draw")
_FIELDS = ("utilization_pct", "memory_used_mib", "power_w")
_TIMEOUT_S = 15


def nvidia_smi_command(executable: str) -> list[str]:
    return [executable, f"--query-gpu={','.join(NVIDIA_SMI_QUERY)}", "--format=csv,noheader,nounits"]


def parse_nvidia_smi_csv(text: str) -> list[dict[str, Any]]:
    """One record per GPU line, in ``nvidia-smi`` index order; ``[N/A]``-style values become None.

    :raises ValueError: a line does not have one value per queried field, or a value is not a number.
    """
    records = []
    for index, line in enumerate(line for line in text.splitlines() if line.strip()):
        values = [value.strip() for value in line.split(",")]
        if len(values) != len(_FIELDS):
            raise ValueError(f"nvidia-smi line {line!r} does not have {len(_FIELDS)} values")
        record: dict[str, Any] = {"index": index}
        for name, value in zip(_FIELDS, values, strict=True):
            if value.startswith("[") and value.endswith("]"):
                record[name] = None
                continue
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(f"nvidia-smi value {value!r} for {name} is not a finite number")
            record[name] = number
        records.append(record)
    return records


def read_gpu_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``gpu_metrics.jsonl``; a line cut short by a killed process is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summarise_gpu_metrics(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Means over every sample and GPU; without GPUs all None, ``gpu_available`` False and the reason."""
    sums = dict.fromkeys(_FIELDS, 0.0)
    counts = dict.fromkeys(_FIELDS, 0)
    samples = 0
    gpus: set[tuple[str, int]] = set()
    reason = None
    for record in records:
        if not record.get("gpu_available"):
            reason = reason or record.get("reason")
            continue
        if not record.get("gpus"):
            continue
        samples += 1
        for gpu in record.get("gpus", []):
            gpus.add((record.get("host", ""), gpu["index"]))
            for name in _FIELDS:
                if gpu.get(name) is not None:
                    sums[name] += gpu[name]
                    counts[name] += 1
    summary: dict[str, Any] = {"gpu_available": samples > 0, "samples": samples, "gpus": len(gpus)}
    for name in _FIELDS:
        summary[f"mean_{name}"] = round(sums[name] / counts[name], 3) if counts[name] else None
    if not samples:
        summary["reason"] = reason or "no GPU samples were recorded"
    return summary


class GpuSampler(threading.Thread):
    """Appends one sample per ``interval_s`` to ``path`` until :meth:`stop`.

    :param executable: ``nvidia-smi`` to run; None looks it up on PATH.
    """

    def __init__(self, path: Path, interval_s: float, executable: str | None = None) -> None:
        super().__init__(name="gpu-sampler", daemon=True)
        self._path = path
        self._interval_s = interval_s
        self._executable = executable or shutil.which("nvidia-smi")
        self._host = socket.gethostname()
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join(timeout=_TIMEOUT_S + 5)

    def run(self) -> None:
        if self._executable is None:
            self._write({"gpu_available": False, "reason": "nvidia-smi not found"})
            return
        first = True
        while True:
            try:
                self._write({"gpu_available": True, "gpus": self._sample()})
            except (OSError, subprocess.SubprocessError, ValueError) as error:
                if first:
                    self._write({"gpu_available": False, "reason": f"nvidia-smi failed: {error}"})
                    return
                self._write({"gpu_available": True, "error": f"nvidia-smi failed: {error}", "gpus": []})
            first = False
            if self._stopped.wait(self._interval_s):
                return

    def _sample(self) -> list[dict[str, Any]]:
        done = subprocess.run(
            nvidia_smi_command(self._executable),
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise OSError(f"exit {done.returncode}: {detail[-1] if detail else 'no output'}")
        return parse_nvidia_smi_csv(done.stdout)

    def _write(self, record: dict[str, Any]) -> None:
        line = {"ts": datetime.now(UTC).isoformat(timespec="seconds"), "host": self._host, **record}
        with open(self._path, "a") as handle:
            handle.write(json.dumps(line) + "\n")
