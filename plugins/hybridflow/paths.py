"""Where the project's checked-in configuration lives, wherever the package is installed."""

from __future__ import annotations

import os
from pathlib import Path


def include_dir() -> Path:
    """``include/``: HYBRIDFLOW_INCLUDE_DIR when set (containers), else the checkout this package sits in."""
    configured = os.environ.get("HYBRIDFLOW_INCLUDE_DIR")
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / "include"


def jobs_dir() -> Path:
    """``jobs/``: the code that runs on the clusters (HYBRIDFLOW_JOBS_DIR when set)."""
    configured = os.environ.get("HYBRIDFLOW_JOBS_DIR")
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / "jobs"
