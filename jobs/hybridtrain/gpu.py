"""GPU utilization sampling inside the training job: every rank runs ``nvidia-smi`` on its own GPU(s) every few
seconds and appends JSON lines to its own file, ``<run_dir>/gpu_metrics.rank<r>.jsonl``::

    {"ts": "...", "host": "gpu-node-01", "rank": 1, "gpu_ids": ["1"], "gpu_available": true,
     "gpus": [{"index": 1, "uuid": "GPU-...", "utilization_pct": 87.0, "memory_used_mib": 30512.0,
               "power_w": 412.3}]}

Which GPUs: the ids Slurm bound to this process (see :func:`bound_gpu_ids`), passed as ``nvidia-smi -i``, so a
rank never reports a GPU of another job or another rank; ``index`` and ``uuid`` are what ``nvidia-smi``
reports, i.e. the real GPU. Under Slurm with device cgroups (``ConstrainDevices=yes``) the job sees only its
GPUs, renumbered from 0 both in CUDA_VISIBLE_DEVICES and in ``nvidia-smi``; the summary therefore tells GPUs
apart by host and uuid (two ranks' "index 0" on one node are different GPUs there).

Why one file per rank: ranks on several nodes write into one run directory on a shared filesystem, and NFS
does not make ``O_APPEND`` atomic across clients, so lines of one shared file could overwrite each other.
:func:`read_run_gpu_metrics` merges every rank's file (and the single ``gpu_metrics.jsonl`` of earlier versions)
on read. Restarts of a run append to the same files.

Where ``nvidia-smi`` does not exist, each rank writes one line saying so (``{"gpu_available": false,
"reason": "nvidia-smi not found", ...}``) and nothing else: numbers are never invented. A value ``nvidia-smi``
reports as ``[N/A]`` is null.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "LEGACY_GPU_METRICS_FILE",
    "NVIDIA_SMI_QUERY",
    "GpuSampler",
    "bound_gpu_ids",
    "gpu_metrics_file",
    "nvidia_smi_command",
    "parse_nvidia_smi_csv",
    "read_gpu_metrics",
    "read_run_gpu_metrics",
    "summarise_gpu_metrics",
    "within",
]

NVIDIA_SMI_QUERY = ("index", "uuid", "utilization.gpu", "memory.used", "power.draw")
LEGACY_GPU_METRICS_FILE = "gpu_metrics.jsonl"
_FIELDS = ("utilization_pct", "memory_used_mib", "power_w")
_ID_LIST_RE = re.compile(r"\d+(,\d+)*")
_TIMEOUT_S = 15


def gpu_metrics_file(run_dir: Path, rank: int) -> Path:
    """The samples file of ``rank``: ``<run_dir>/gpu_metrics.rank<r>.jsonl``."""
    return run_dir / f"gpu_metrics.rank{rank}.jsonl"


def bound_gpu_ids(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The GPU ids this process may use, as ``nvidia-smi -i`` takes them; None means every GPU it can see, ``()``
    none (CUDA_VISIBLE_DEVICES set empty, as a job placed on the CPU partition has it: CUDA then shows no GPU,
    and sampling the node's GPUs would count other jobs' work as this one's).

    CUDA_VISIBLE_DEVICES when it lists numeric ids (Slurm sets it per task; it is in ``nvidia-smi``'s
    numbering when Slurm's ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` convention holds), else SLURM_STEP_GPUS, else
    SLURM_JOB_GPUS (the ids Slurm allocated), else None. UUIDs or MIG names in CUDA_VISIBLE_DEVICES are not
    numeric ids and fall through to Slurm's variables.
    """
    if environ.get("CUDA_VISIBLE_DEVICES") == "":
        return ()
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = environ.get(name, "").replace(" ", "")
        if _ID_LIST_RE.fullmatch(value):
            return tuple(value.split(","))
    return None


def nvidia_smi_command(executable: str, gpu_ids: Iterable[str] | None = None) -> list[str]:
    """``nvidia-smi [-i <ids>] --query-gpu=index,uuid,utilization.gpu,memory.used,power.draw ...``."""
    select = ["-i", ",".join(gpu_ids)] if gpu_ids else []
    return [
        executable,
        *select,
        f"--query-gpu={','.join(NVIDIA_SMI_QUERY)}",
        "--format=csv,noheader,nounits",
    ]


def parse_nvidia_smi_csv(text: str) -> list[dict[str, Any]]:
    """One record per GPU line: ``index`` and ``uuid`` as ``nvidia-smi`` reports them, and the figures, where
    ``[N/A]``-style values become None.

    :raises ValueError: a line does not have one value per queried field, or a value is not a number.
    """
    records = []
    for line in (line for line in text.splitlines() if line.strip()):
        values = [value.strip() for value in line.split(",")]
        if len(values) != len(NVIDIA_SMI_QUERY):
            raise ValueError(f"nvidia-smi line {line!r} does not have {len(NVIDIA_SMI_QUERY)} values")
        index, uuid, *figures = values
        record: dict[str, Any] = {"index": int(index), "uuid": uuid}
        for name, value in zip(_FIELDS, figures, strict=True):
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
    """The records of one samples file; a line cut short by a killed process is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_run_gpu_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's records of a run (``gpu_metrics.rank*.jsonl`` and a legacy ``gpu_metrics.jsonl``), in
    time order."""
    paths = [run_dir / LEGACY_GPU_METRICS_FILE, *sorted(run_dir.glob("gpu_metrics.rank*.jsonl"))]
    records = [record for path in paths for record in read_gpu_metrics(path)]
    return sorted(records, key=lambda record: str(record.get("ts", "")))


def within(records: Iterable[dict[str, Any]], windows: Iterable[tuple[float, float]]) -> list[dict[str, Any]]:
    """The records whose ``ts`` falls inside one of ``windows`` (epoch seconds, both ends included)."""
    windows = list(windows)
    chosen = []
    for record in records:
        try:
            at = datetime.fromisoformat(str(record.get("ts"))).timestamp()
        except ValueError:
            continue
        if any(start <= at <= end for start, end in windows):
            chosen.append(record)
    return chosen


def summarise_gpu_metrics(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Means over every sample and GPU, and per GPU (host + index, told apart by uuid); without GPUs all None,
    ``gpu_available`` False and the reason.

    ``samples`` counts the sampler lines that measured at least one GPU (over all ranks).
    """
    sums = dict.fromkeys(_FIELDS, 0.0)
    counts = dict.fromkeys(_FIELDS, 0)
    samples = 0
    per_gpu: dict[tuple[str, str], dict[str, Any]] = {}
    reason = None
    for record in records:
        if not record.get("gpu_available"):
            reason = reason or record.get("reason")
            continue
        if not record.get("gpus"):
            continue
        samples += 1
        host = str(record.get("host", ""))
        for gpu in record["gpus"]:
            key = (host, str(gpu.get("uuid") or gpu["index"]))
            entry = per_gpu.setdefault(
                key,
                {"host": host, "index": gpu["index"], "uuid": gpu.get("uuid"), "ranks": set(), "util": []},
            )
            if record.get("rank") is not None:
                entry["ranks"].add(record["rank"])
            if gpu.get("utilization_pct") is not None:
                entry["util"].append(gpu["utilization_pct"])
            for name in _FIELDS:
                if gpu.get(name) is not None:
                    sums[name] += gpu[name]
                    counts[name] += 1
    summary: dict[str, Any] = {"gpu_available": samples > 0, "samples": samples, "gpus": len(per_gpu)}
    for name in _FIELDS:
        summary[f"mean_{name}"] = round(sums[name] / counts[name], 3) if counts[name] else None
    summary["per_gpu"] = [
        {
            "host": entry["host"],
            "index": entry["index"],
            "uuid": entry["uuid"],
            "ranks": sorted(entry["ranks"]),
            "samples": len(entry["util"]),
            "mean_utilization_pct": round(sum(entry["util"]) / len(entry["util"]), 3) if entry["util"] else None,
        }
        for entry in sorted(per_gpu.values(), key=lambda entry: (entry["host"], entry["index"], entry["uuid"] or ""))
    ]
    if not samples:
        summary["reason"] = reason or "no GPU samples were recorded"
    return summary


class GpuSampler(threading.Thread):
    """Appends one sample per ``interval_s`` to ``path`` until :meth:`stop`.

    :param executable: ``nvidia-smi`` to run; None looks it up on PATH.
    :param rank: recorded in every line (None: not recorded).
    :param gpu_ids: the GPUs to query (``nvidia-smi -i``); None queries every GPU ``nvidia-smi`` shows, ``()``
        none (the process has no GPU: one line says so).
    """

    def __init__(
        self,
        path: Path,
        interval_s: float,
        executable: str | None = None,
        *,
        rank: int | None = None,
        gpu_ids: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(name="gpu-sampler", daemon=True)
        self._path = path
        self._interval_s = interval_s
        self._executable = executable or shutil.which("nvidia-smi")
        self._host = socket.gethostname()
        self._static: dict[str, Any] = {"host": self._host}
        if rank is not None:
            self._static["rank"] = rank
        if gpu_ids is not None:
            self._static["gpu_ids"] = list(gpu_ids)
        self._gpu_ids = gpu_ids
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join(timeout=_TIMEOUT_S + 5)

    def run(self) -> None:
        if self._gpu_ids == ():
            self._write({"gpu_available": False, "reason": "no GPU bound to this process (CUDA_VISIBLE_DEVICES empty)"})
            return
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
            nvidia_smi_command(self._executable, self._gpu_ids),
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
        """One ``write`` of one whole line with O_APPEND: a reader (or a restart's sampler) never sees two
        lines mixed, and a line cut by a kill is skipped on read."""
        # milliseconds: the loop's step window (loop_window) may last about a second
        line = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), **self._static, **record}
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
