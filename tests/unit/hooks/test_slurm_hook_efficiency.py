"""How the Slurm hook reads an ended job's accounting. A scripted stand-in replaces the SSH command (the process
boundary): a slurmdbd that refuses one query, or answers before it has the job's end, cannot be timed against the
real one; tests/integration/test_slurm_operator.py reads real accounting end to end."""

from __future__ import annotations

import pytest
from hybridflow.exceptions import SlurmConnectionError, SlurmOutputParseError
from hybridflow.hooks.slurm import RemoteResult, SlurmHook

SETTLED = """\
973|COMPLETED|2026-12-06T04:53:17|2026-12-06T04:53:18|2026-12-06T04:53:21|3|5|00:03.074|1||100M|billing=1,cpu=1,gres/gpu=1,node=1
973.batch|COMPLETED|2026-12-06T04:53:18|2026-12-06T04:53:18|2026-12-06T04:53:21|3||00:03.074|1|||cpu=1,gres/gpu=1,mem=0,node=1
"""
RUNNING = ("973|RUNNING|2026-12-06T04:53:17|2026-12-06T04:53:18|Unknown|3|5|00:00:00|1||100M|"
           "billing=1,cpu=1,gres/gpu=1,node=1\n")
REFUSED = RemoteResult(1, "", "sacct: error: Problem talking to the database: Connection refused")
GARBLED = RemoteResult(0, "973|COMPLETED|half a line\n", "")


class _Sacct(SlurmHook):
    def __init__(self, answers):
        super().__init__("slurm_test")
        self.answers = list(answers)
        self.calls = 0

    @property
    def endpoint(self) -> str:
        return "hpc@login:22"

    def run(self, argv, stdin=None, timeout_s=None):
        assert argv[0] == "sacct"
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr("hybridflow.hooks.slurm.time.sleep", lambda seconds: None)


@pytest.mark.parametrize("first", [REFUSED, GARBLED, RemoteResult(0, RUNNING, ""), RemoteResult(0, "", "")],
                         ids=["refused", "garbled", "end-not-recorded-yet", "not-recorded-yet"])
def test_a_passing_accounting_hiccup_is_read_again(first):
    hook = _Sacct([first, RemoteResult(0, SETTLED, "")])
    figures = hook.efficiency("973", settle_s=30)
    assert (figures["runs"], figures["elapsed_s"], hook.calls) == (1, 3, 2)


@pytest.mark.parametrize(("answer", "error", "message"), [
    (REFUSED, SlurmConnectionError, "sacct on hpc@login:22 failed .exit 1.: sacct: error: Problem talking"),
    (GARBLED, SlurmOutputParseError, "expected 12 '.'-separated fields"),
], ids=["refused", "garbled"])
def test_accounting_that_stays_unreadable_raises_the_last_error(monkeypatch, answer, error, message):
    clock = iter(range(0, 1000))
    monkeypatch.setattr("hybridflow.hooks.slurm.time.monotonic", lambda: next(clock))
    hook = _Sacct([answer])
    with pytest.raises(error, match=message):
        hook.efficiency("973", settle_s=5)
    assert 2 <= hook.calls <= 6, "read again within the settle window, then given up"


def test_a_record_that_never_settles_is_reported_as_it_stands(monkeypatch):
    clock = iter(range(0, 1000))
    monkeypatch.setattr("hybridflow.hooks.slurm.time.monotonic", lambda: next(clock))
    figures = _Sacct([RemoteResult(0, RUNNING, "")]).efficiency("973", settle_s=5)
    assert figures["runs"] == 1 and figures["elapsed_s"] == 3
