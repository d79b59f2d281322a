"""Fixtures of the reliability tests (the REST client ``api`` comes from tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def log_dir(stack):
    from hybridflow.hooks.slurm import SlurmHook

    path = f"{stack['HYBRIDFLOW_STORAGE_ROOT']}/runs/reliability-{uuid.uuid4().hex[:8]}"
    yield path
    hook = SlurmHook()
    try:
        hook.run(["rm", "-rf", "--", path])
    finally:
        hook.close()
