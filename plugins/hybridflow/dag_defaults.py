"""Defaults every DAG of the suite shares: owner, retries, tags. DAG files stay wiring only."""

from __future__ import annotations

from datetime import timedelta

OWNER = "ml-platform"

DEFAULT_ARGS = {
    "owner": OWNER,
    "retries": 2,
    "retry_delay": timedelta(minutes=1),
    "retry_exponential_backoff": True,
}
