"""Host key pinning against the real sshd: the task's hook (paramiko) and the trigger's (asyncssh) trust the
connection's 'host_key' extra and nothing else; never ~/.ssh/known_hosts, never an extra that skips the check.

Every case runs with a HOME of its own whose ~/.ssh/known_hosts lists the server's real key (the real HOME is
never touched), so a refusal proves that known_hosts did not stand in for the pin. A refusal must come before any
command runs: each hook is asked to `touch` a marker, which must not appear.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hybridflow.exceptions import SlurmConnectionError
from hybridflow.hooks.slurm import SlurmAsyncHook, SlurmHook
from hybridflow.triggers.slurm import SlurmJobTrigger


def other_host_key() -> str:
    public = Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


NO_PIN = "has no 'host_key' extra"
DISABLES = "disables host key verification"
MISMATCH = "does NOT match"

# name -> (changes to the stack's slurm_ssh extra, None = drop the key; what the refusal says). Checks that are
# skipped or loosened are refused with and without a pin: they say the operator meant to connect unverified.
REFUSED = {
    "wrong_key": ({"host_key": other_host_key()}, MISMATCH),
    "missing_key": ({"host_key": None}, NO_PIN),
    "empty_key": ({"host_key": ""}, NO_PIN),
    "no_host_key_check": ({"host_key": None, "no_host_key_check": True}, "no_host_key_check: true"),
    "no_host_key_check_as_text": ({"host_key": None, "no_host_key_check": "True"}, "no_host_key_check: true"),
    "allow_host_key_change": ({"host_key": None, "allow_host_key_change": True}, "allow_host_key_change: true"),
    "allow_host_key_change_pinned": ({"allow_host_key_change": True}, "allow_host_key_change: true"),
    "known_hosts_none": ({"host_key": None, "known_hosts": "none"}, "known_hosts: none"),
    "known_hosts_none_pinned": ({"known_hosts": "none"}, "known_hosts: none"),
}
# Refused on the connection's extras alone: no socket is opened at all.
REFUSED_BEFORE_CONNECTING = {name for name, (_, says) in REFUSED.items() if says != MISMATCH}


@pytest.fixture
def server(stack, tmp_path, monkeypatch):
    """The stack's slurm_ssh connection, a HOME whose known_hosts lists the real key, and a marker path."""
    conn = json.loads(stack["AIRFLOW_CONN_SLURM_SSH"])
    real_key = conn["extra"]["host_key"]
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"[{conn['host']}]:{conn['port']} {real_key}\n")
    monkeypatch.setenv("HOME", str(home))
    marker = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "scratch" / f"hostkey-{uuid.uuid4().hex[:8]}"
    yield conn, home, marker
    marker.unlink(missing_ok=True)


@pytest.fixture
def connection(server, monkeypatch):
    """Registers a copy of slurm_ssh with its extra changed; returns the new connection's id."""
    base, _, _ = server

    def make(name: str, changes: dict) -> str:
        extra = {key: value for key, value in (base["extra"] | changes).items() if value is not None}
        conn_id = f"hostkey_{name}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(base | {"extra": extra}))
        return conn_id

    return make


@pytest.fixture
def connects(monkeypatch):
    """Records every SSH connection attempt of either library (and lets it through)."""
    import asyncssh
    import paramiko

    calls: list[str] = []
    sync_connect, async_connect = paramiko.SSHClient.connect, asyncssh.connect

    def spy_sync(self, *args, **kwargs):
        calls.append("paramiko")
        return sync_connect(self, *args, **kwargs)

    async def spy_async(*args, **kwargs):
        calls.append("asyncssh")
        return await async_connect(*args, **kwargs)

    monkeypatch.setattr(paramiko.SSHClient, "connect", spy_sync)
    monkeypatch.setattr(asyncssh, "connect", spy_async)
    return calls


def sync_touch(conn_id: str, marker: Path) -> None:
    # One attempt: the provider would retry a refused key after a 3-5 s sleep.
    hook = SlurmHook(conn_id, conn_retry_attempts=1)
    try:
        assert hook.run(["touch", "--", str(marker)]).returncode == 0
    finally:
        hook.close()


def async_touch(conn_id: str, marker: Path) -> None:
    async def touch():
        hook = SlurmAsyncHook(conn_id)
        try:
            assert (await hook.run(["touch", "--", str(marker)])).returncode == 0
        finally:
            await hook.close()

    asyncio.run(asyncio.wait_for(touch(), 30))


def first_event(trigger) -> dict:
    async def first():
        events = trigger.run()
        try:
            return (await anext(events)).payload
        finally:
            await events.aclose()

    return asyncio.run(asyncio.wait_for(first(), 60))


def assert_names_connection_and_fix(message: str, conn_id: str, says: str) -> None:
    assert says in message and repr(conn_id) in message and "'host_key' extra" in message, message


# --- the task's hook (paramiko) --------------------------------------------------------------------------------


def test_sync_hook_with_the_pinned_key_runs_commands(server, connection):
    _, _, marker = server
    sync_touch(connection("pinned", {}), marker)
    assert marker.exists()


def test_sync_hook_with_the_pinned_key_needs_no_known_hosts(server, connection):
    _, home, marker = server
    (home / ".ssh" / "known_hosts").unlink()
    sync_touch(connection("pinned_alone", {"known_hosts": None}), marker)
    assert marker.exists()


@pytest.mark.parametrize("touch", [sync_touch, async_touch], ids=["task-hook", "trigger-hook"])
@pytest.mark.parametrize("case", REFUSED)
def test_hook_refuses_before_any_command(case, touch, server, connection, connects):
    """The task's hook (paramiko) and the trigger's hook (asyncssh) refuse alike."""
    _, _, marker = server
    changes, says = REFUSED[case]
    conn_id = connection(case, changes)
    with pytest.raises(SlurmConnectionError) as refused:
        touch(conn_id, marker)
    assert_names_connection_and_fix(str(refused.value), conn_id, says)
    assert not marker.exists()
    if case in REFUSED_BEFORE_CONNECTING:
        assert connects == []


def test_sync_hook_refuses_a_wrong_pin_in_the_key_exchange_without_known_hosts(server, connection):
    _, home, marker = server
    (home / ".ssh" / "known_hosts").unlink()
    conn_id = connection("wrong_key_alone", {"host_key": other_host_key()})
    with pytest.raises(SlurmConnectionError, match=MISMATCH):
        sync_touch(conn_id, marker)
    assert not marker.exists()


def test_sync_hook_names_a_stale_known_hosts_entry(server, connection):
    """paramiko checks ~/.ssh/known_hosts before the pin: another key there refuses (never accepts) the server."""
    conn, home, marker = server
    (home / ".ssh" / "known_hosts").write_text(f"[{conn['host']}]:{conn['port']} {other_host_key()}\n")
    with pytest.raises(SlurmConnectionError, match="stale entry") as refused:
        sync_touch(connection("stale_known_hosts", {}), marker)
    assert "ssh-keygen -R" in str(refused.value)
    assert not marker.exists()


# --- the trigger's hook (asyncssh) -----------------------------------------------------------------------------


def test_async_hook_with_the_pinned_key_runs_commands(server, connection):
    _, _, marker = server
    async_touch(connection("pinned", {}), marker)
    assert marker.exists()


def test_async_hook_trusts_the_pin_over_a_stale_known_hosts_entry(server, connection):
    conn, home, marker = server
    (home / ".ssh" / "known_hosts").write_text(f"[{conn['host']}]:{conn['port']} {other_host_key()}\n")
    async_touch(connection("stale_known_hosts", {}), marker)
    assert marker.exists()


def test_job_trigger_with_the_pinned_key_follows_a_real_job(server, connection):
    hook = SlurmHook()  # the stack's own connection submits; the trigger follows over the copy under test
    try:
        job_id = hook.submit("#!/bin/bash\n#SBATCH --partition=gpu-training\n#SBATCH --time=1\n"
                             "#SBATCH --output=/dev/null\ntrue\n")
    finally:
        hook.close()
    event = first_event(SlurmJobTrigger(job_id, connection("pinned", {}), min_poll_interval_s=0.2,
                                        poll_interval_s=0.5))
    assert event["status"] == "success" and event["state"] == "COMPLETED", event


@pytest.mark.parametrize("case", REFUSED)
def test_job_trigger_ends_in_error_without_retrying(case, server, connection, connects):
    """A refused host key is final: the trigger reports it at once rather than reconnecting for its budget."""
    changes, says = REFUSED[case]
    conn_id = connection(case, changes)
    event = first_event(SlurmJobTrigger("1", conn_id, reconnect_budget_s=300))
    assert event["status"] == "error", event
    assert_names_connection_and_fix(event["message"], conn_id, says)
    assert len(connects) == (0 if case in REFUSED_BEFORE_CONNECTING else 1)
