"""The training job runs on the cluster with torch, deepspeed, pyarrow, numpy and pandas only: no Airflow. Of the
jobs' shared package it uses only modules shipped beside it that need no more than that: the atomic writes
(``hybridjobs.atomic``), the names of the run directory's files (``hybridjobs.layout``) and the storage URIs and
partition protocol (``hybridjobs.objectstore``, pyarrow)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[4] / "jobs"
SOURCES = [JOBS / "train.py", *sorted((JOBS / "hybridtrain").glob("*.py"))]
ALLOWED_THIRD_PARTY = {"torch", "deepspeed", "numpy", "pyarrow", "pandas"}
SHARED_FOR_TRAINING = {"hybridjobs.atomic", "hybridjobs.layout", "hybridjobs.objectstore"}


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "hybridjobs":
            modules |= {f"hybridjobs.{alias.name}" for alias in node.names}  # from hybridjobs import atomic
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


def imported_top_level_modules(path: Path) -> set[str]:
    return {module.split(".")[0] for module in imported_modules(path)}


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.relative_to(JOBS).as_posix())
def test_training_job_imports_only_the_cluster_dependencies(path):
    foreign = (
        imported_top_level_modules(path)
        - set(sys.stdlib_module_names)
        - ALLOWED_THIRD_PARTY
        - {"hybridtrain", "hybridjobs"}
    )
    assert not foreign, (
        f"{path} imports {sorted(foreign)}; the training job must not need Airflow or the package"
    )
    shared = {module for module in imported_modules(path) if module.split(".")[0] == "hybridjobs"}
    assert shared <= SHARED_FOR_TRAINING, (
        f"{path} imports {sorted(shared)}; of hybridjobs only {sorted(SHARED_FOR_TRAINING)} need no more than the "
        f"cluster's dependencies")


@pytest.mark.parametrize("module", sorted(SHARED_FOR_TRAINING))
def test_the_shared_modules_the_training_job_uses_need_only_the_cluster_dependencies(module):
    path = JOBS / (module.replace(".", "/") + ".py")
    assert imported_top_level_modules(path) <= set(sys.stdlib_module_names) | ALLOWED_THIRD_PARTY
    assert {m for m in imported_modules(path) if m.startswith("hybridjobs")} <= SHARED_FOR_TRAINING
