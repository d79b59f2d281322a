"""The training job runs on the cluster with torch, deepspeed, pyarrow, numpy and pandas only: no Airflow. Of the
jobs' shared package it uses only standard-library modules shipped beside it: the atomic writes
(``hybridjobs.atomic``) and the names of the run directory's files (``hybridjobs.layout``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[4] / "jobs"
SOURCES = [JOBS / "train.py", *sorted((JOBS / "hybridtrain").glob("*.py"))]
ALLOWED_THIRD_PARTY = {"torch", "deepspeed", "numpy", "pyarrow", "pandas"}
STDLIB_ONLY_SHARED = {"hybridjobs.atomic", "hybridjobs.layout"}


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
    assert shared <= STDLIB_ONLY_SHARED, (
        f"{path} imports {sorted(shared)}; of hybridjobs only {sorted(STDLIB_ONLY_SHARED)} are stdlib-only")


@pytest.mark.parametrize("module", sorted(STDLIB_ONLY_SHARED))
def test_the_shared_modules_the_training_job_uses_need_only_the_standard_library(module):
    path = JOBS / (module.replace(".", "/") + ".py")
    assert imported_top_level_modules(path) <= set(sys.stdlib_module_names)
