"""The jobs' storage layout (jobs/hybridjobs/layout.py) and the plugin's (plugins/hybridflow/layout.py) agree: the
plugin reads and hands out the partitions the jobs publish, so both must name the same paths for the same inputs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from hybridflow import layout as plugin

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "jobs"))
from hybridjobs import layout as jobs  # noqa: E402
from hybridjobs import storage  # noqa: E402
from hybridtrain.features import partition_path  # noqa: E402

ROOTS = ["/var/lib/hybridflow/storage", "/st", "/trailing/", "relative/root", "/with space/ü"]
DS = ["2026-01-05", "2024-02-29"]
# A dataset name the plugin side passes to the layout, in plugins/ and dags/: layout.partition("raw", ...).
USE = re.compile(r"layout\.(?:partition|dataset)\(\s*[\"']([a-z_]+)[\"']")


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("ds", DS)
@pytest.mark.parametrize("dataset", jobs.DATASETS)
def test_both_layouts_name_the_same_dataset_paths(root, ds, dataset):
    mine, theirs = plugin.StorageLayout(root), jobs.StorageLayout(root)
    assert mine.dataset(dataset) == theirs.dataset(dataset)
    assert mine.partition(dataset, ds) == theirs.partition(dataset, ds)
    assert Path(mine.partition(dataset, ds)) == storage.partition_dir(root, dataset, ds)


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
