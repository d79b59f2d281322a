"""End-to-end: whole DAG runs on the running local Airflow (scheduler, LocalExecutor, triggerer), driven through
its REST API (the ``api`` fixture) exactly as the UI and `make demo` drive it."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
