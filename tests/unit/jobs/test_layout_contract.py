"""The jobs' storage layout (jobs/hybridjobs/layout.py) and the plugin's (plugins/hybridflow/layout.py) agree: the
plugin reads and hands out the partitions the jobs publish, and reads the files a training job writes in its run
directory, so both must name the same paths for the same inputs."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridflow import layout as plugin
from hybridjobs import layout as jobs
from hybridjobs import storage
from hybridtrain.config import RunConfig
from hybridtrain.features import partition_path
from hybridtrain.heartbeat import heartbeat_file

REPO = Path(__file__).resolve().parents[3]
ROOTS = ["/var/lib/hybridflow/storage", "/st", "/trailing/", "relative/root", "/with space/ü"]
DS = ["2026-01-05", "2024-02-29"]
# A dataset name the plugin side passes to the layout, in plugins/ and dags/: layout.partition("raw", ...).
USE = re.compile(r"layout\.(?:partition|dataset)\(\s*[\"']([a-z_]+)[\"']")
# The names of a run directory's members that the job writes and the plugin reads: (name, TrainingRunDir member).
RUN_DIR_NAMES = [
    ("PROGRESS_FILE", "progress"), ("HEARTBEATS_DIR", "heartbeats"), ("METRICS_FILE", "metrics"),
    ("STEP_METRICS_FILE", "step_metrics"), ("CHECKPOINTS_DIR", "checkpoints"), ("EXPORT_DIR", "export"),
]
EXPORT_NAMES = ["MODEL_FILE", "SIGNATURE_FILE", "SMOKE_FILE"]


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("ds", DS)
@pytest.mark.parametrize("dataset", jobs.DATASETS)
def test_both_layouts_name_the_same_dataset_paths(root, ds, dataset):
    mine, theirs = plugin.StorageLayout(root), jobs.StorageLayout(root)
    assert mine.dataset(dataset) == theirs.dataset(dataset)
    assert mine.partition(dataset, ds) == theirs.partition(dataset, ds)
    assert Path(mine.partition(dataset, ds)) == storage.partition_dir(root, dataset, ds)
    assert Path(mine.partition(dataset, ds)) == storage.Partitions.under(root).dir(dataset, ds)


@pytest.mark.parametrize("root", ROOTS)
def test_the_training_job_finds_the_partitions_the_features_job_publishes(root):
    """The plugin hands the training job ``features_root``; the job builds each ds's partition under it."""
    features_root = plugin.StorageLayout(root).dataset("features")
    for ds in DS:
        assert partition_path(features_root, ds) == jobs.StorageLayout(root).partition("features", ds)


def test_the_plugin_only_reads_datasets_the_jobs_publish():
    sources = [*(REPO / "plugins").rglob("*.py"), *(REPO / "dags").glob("*.py")]
    used = {name for path in sources for name in USE.findall(path.read_text())}
    assert used, "no layout.partition/dataset call found: the pattern no longer matches the code"
    assert used <= set(jobs.DATASETS), sorted(used - set(jobs.DATASETS))


@pytest.mark.parametrize(("name", "member"), RUN_DIR_NAMES)
@pytest.mark.parametrize("root", ROOTS)
def test_the_plugin_reads_the_run_directory_files_where_the_job_writes_them(root, name, member):
    assert getattr(plugin, name) == getattr(jobs, name)
    assert getattr(plugin.TrainingRunDir(root), member) == f"{root}/{getattr(jobs, name)}"


@pytest.mark.parametrize("name", [*EXPORT_NAMES, "CHECKPOINT_MANIFEST"])
def test_both_layouts_name_the_export_and_checkpoint_files_alike(name):
    assert getattr(plugin, name) == getattr(jobs, name)
    assert plugin.TrainingRunDir("/r").export_file(jobs.MODEL_FILE) == plugin.TrainingRunDir("/r").model
    assert plugin.EXPORT_FILES == tuple(getattr(jobs, n) for n in EXPORT_NAMES)


def test_the_jobs_own_paths_are_the_plugins():
    """The job builds its paths from its config's run_dir; they land on the plugin's members of the same root."""
    run_dir = Path("/st/runs/nightly_training/ds=2026-01-05/r.retrain-1")
    config = SimpleNamespace(run_dir=run_dir)  # all the properties read
    mine = plugin.TrainingRunDir(str(run_dir))
    assert str(RunConfig.checkpoints_dir.fget(config)) == mine.checkpoints
    assert str(RunConfig.export_dir.fget(config)) == mine.export
    assert str(heartbeat_file(run_dir, 3)) == f"{mine.heartbeats}/rank3.json"
