"""What the Spark benchmarks share: jobs/ on sys.path, a session like the jobs', the machine's context."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
if str(JOBS) not in sys.path:
    sys.path.insert(0, str(JOBS))

MASTER = os.environ.get("HYBRIDFLOW_BENCH_MASTER", "local[2]")


def python_env() -> dict[str, str]:
    """Executors run their Python workers with this interpreter (it has torch, pandas and pyarrow)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    return {"PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"]}


def session(app_name: str, driver_memory: str = "2g"):
    python_env()
    from hybridjobs.spark import build_session

    return build_session(app_name, {
        "spark.master": MASTER,
        "spark.driver.memory": driver_memory,
        "spark.ui.enabled": "false",
        "spark.log.level": "ERROR",
        "spark.ui.showConsoleProgress": "false",
    })


def machine() -> dict[str, object]:
    """Context for reading the figures: the cores are shared with other people's work."""
    return {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "master": MASTER,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def mlp(n_features: int, path: Path):
    """The benchmark model: a small propensity MLP, TorchScript, float32 [B, n] -> [B, 1]."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(n_features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 1), torch.nn.Sigmoid(),
    ).eval()
    torch.jit.script(model).save(str(path))
    return model
