"""The process's place in the job: torch.distributed variables from the launcher, from Slurm, or defaults.

Precedence per variable: already set (torchrun, the deepspeed launcher) > derived from Slurm > single-process
default. Slurm's task variables count only inside an ``srun`` step (``SLURM_STEP_NUM_TASKS``): the batch
script itself is one process even when the allocation has several tasks.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterable, Mapping

__all__ = [
    "cuda_device_index",
    "describe_ranks",
    "distributed_environment",
    "first_node",
    "free_port",
    "log_format",
    "node_name",
    "restart_count",
]

_BRACKET_RE = re.compile(r"\[([^\]]*)\]")
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu-[01-04,07],cpu1"`` -> ``"gpu-01"``."""
    depth = 0
    end = len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    return _BRACKET_RE.sub(lambda match: re.split(r"[-,]", match.group(1))[0], nodelist[:end].strip())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_environment(environ: Mapping[str, str], pick_port: Callable[[], int]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for this process.

    :param environ: the process environment.
    :param pick_port: returns a free local port, for a single-node run that was given none.
    """
    in_srun_step = "SLURM_STEP_NUM_TASKS" in environ
    slurm = {
        "RANK": environ.get("SLURM_PROCID"),
        "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS"),
        "LOCAL_RANK": environ.get("SLURM_LOCALID"),
    }
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    result = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        result[name] = environ.get(name) or (slurm[name] if in_srun_step else None) or defaults[name]
    multi_process = int(result["WORLD_SIZE"]) > 1
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if environ.get("MASTER_ADDR"):
        result["MASTER_ADDR"] = environ["MASTER_ADDR"]
    elif multi_process and nodelist:
        result["MASTER_ADDR"] = first_node(nodelist)
    else:
        result["MASTER_ADDR"] = "127.0.0.1"
    if environ.get("MASTER_PORT"):
        result["MASTER_PORT"] = environ["MASTER_PORT"]
    elif multi_process and environ.get("SLURM_JOB_ID", "").isdigit():
        result["MASTER_PORT"] = str(_SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % _SLURM_PORT_SPAN)
    elif multi_process:
        raise ValueError("WORLD_SIZE > 1 needs MASTER_PORT (or SLURM_JOB_ID) so every rank agrees on it")
    else:
        result["MASTER_PORT"] = str(pick_port())
    return result


def restart_count(environ: Mapping[str, str], previous: int | None) -> int:
    """How many times this run has restarted: Slurm's ``SLURM_RESTART_COUNT`` when set, else one more than the
    count in the run's previous progress file (``previous``; None when this is the first start)."""
    value = environ.get("SLURM_RESTART_COUNT", "")
    if value.isdigit():
        return int(value)
    return 0 if previous is None else previous + 1


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device index this rank uses.

    Slurm binds one GPU per task (``--gpus-per-task=1``, ``--gpu-bind``), so CUDA_VISIBLE_DEVICES lists one id
    and that GPU is ``cuda:0`` whatever LOCAL_RANK is: ``cuda:<local_rank>`` would not exist on rank 1 of a
    node. A launcher that shows every GPU of the node to every rank (torchrun, a task holding all GPUs) leaves
    several visible, and then local rank ``l`` takes ``cuda:l``.

    :param device_count: ``torch.cuda.device_count()``, the GPUs this process can see.
    """
    return local_rank if device_count > 1 and device_count > local_rank else 0


def node_name(environ: Mapping[str, str], hostname: str) -> str:
    """The node's name as Slurm knows it (SLURMD_NODENAME), else the short host name."""
    return environ.get("SLURMD_NODENAME") or hostname.split(".")[0] or hostname


def log_format(rank: str | int, node: str) -> str:
    """The job's log line format: ``<time> rank1@gpu-node-02 ERROR hybridtrain: ...``, so one merged stream
    of every rank's stderr (srun's) still says which process on which node wrote each line."""
    return f"%(asctime)s rank{rank}@{node} %(levelname)s %(name)s: %(message)s"


def describe_ranks(ranks: Iterable[Mapping[str, object]]) -> tuple[int, str]:
    """The number of distinct nodes and a one-line placement, ``"0@gpu-node-01, 1@gpu-node-02"``.

    :param ranks: one ``{"rank", "node", "local_rank"}`` per process (what ``all_gather_object`` returned).
    """
    ordered = sorted(ranks, key=lambda entry: int(entry["rank"]))
    nodes = {str(entry["node"]) for entry in ordered}
    return len(nodes), ", ".join(f"{entry['rank']}@{entry['node']}" for entry in ordered)
