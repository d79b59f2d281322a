"""Waiting for a moment a test needs (instead of sleeping and hoping), and a DAG run on a thread of its own while
the test injects a fault."""

from __future__ import annotations

import threading
import time

import pytest


def wait_until(what: str, check, timeout_s: float, every_s: float = 0.5):
    """``check()`` every ``every_s`` until it returns something true, which is returned; fails the test, naming
    ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_in_thread(function, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """``function(*args, **kwargs)`` (a ``run_dag``) on a daemon thread; hand the pair to ``joined``."""
    box: dict = {}

    def target():
        try:
            box["result"] = function(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict, timeout_s: float) -> dict:
    """What the ``run_in_thread`` call returned (its exception raised here), once it ended within ``timeout_s``."""
    thread.join(timeout_s)
    assert not thread.is_alive(), "the DAG run did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]
