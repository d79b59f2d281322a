from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from helpers.feature_partitions import write_features
from hybridflow.hooks.slurm import SlurmHook


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


# --- Training on the real Slurm: features the job user can read, a run directory it can write -------------

DAYS = ("2026-01-01", "2026-01-02")
CODE = "/var/lib/hybridflow/code"


@pytest.fixture
def training_area(stack):
    """Features readable by the job user and a run directory it can write, on the shared storage."""
    storage = Path(stack["HYBRIDFLOW_STORAGE_ROOT"])
    tag = uuid.uuid4().hex[:8]
    features = storage / "features" / f"test-{tag}"
    for seed, ds in enumerate(DAYS):
        write_features(features, ds, seed)
    run_dir = f"{storage}/runs/test-train-{tag}"
    yield features, run_dir
    shutil.rmtree(features)
    hook = SlurmHook()
    hook.run(["rm", "-rf", "--", run_dir])
    hook.close()


def training_run_config(features: Path, **changes) -> dict:
    return {
        "features_root": str(features), "ds_range": {"start": DAYS[0], "end": DAYS[-1]},
        "model": {"preset": "tiny"}, "epochs": None, "max_steps": 120, "batch_size": 32, "learning_rate": 0.02,
        "checkpoint_every_steps": 20, "seed": 7, "zero_stage": 1,
        "deepspeed_config": f"{CODE}/include/deepspeed/zero1.json", "log_every_steps": 10,
        "progress_every_s": 0.5, "torch_threads": 1,
    } | changes


@pytest.fixture
def make_run_config():
    """The training run config of the Slurm tests (tiny model, two days of features); keyword args override."""
    return training_run_config
