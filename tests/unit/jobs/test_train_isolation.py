"""The training job runs on the cluster with torch, deepspeed, pyarrow, numpy and pandas only: no Airflow."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[3] / "jobs"
SOURCES = [JOBS / "train.py", *sorted((JOBS / "hybridtrain").glob("*.py"))]
ALLOWED_THIRD_PARTY = {"torch", "deepspeed", "numpy", "pyarrow", "pandas"}


def imported_top_level_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.relative_to(JOBS).as_posix())
def test_training_job_imports_only_the_cluster_dependencies(path):
    foreign = (
        imported_top_level_modules(path)
        - set(sys.stdlib_module_names)
        - ALLOWED_THIRD_PARTY
        - {"hybridtrain"}
    )
    assert not foreign, (
        f"{path} imports {sorted(foreign)}; the training job must not need Airflow or the package"
    )
