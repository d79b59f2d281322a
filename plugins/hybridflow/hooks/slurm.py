"""Slurm over SSH: the ssh provider's hook for the connection, with host keys always verified."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from airflow.providers.common.compat.connection import get_async_connection
from airflow.providers.ssh.hooks.ssh import SSHHook, SSHHookAsync
from airflow.sdk import BaseHook

from hybridflow.exceptions import (
    SlurmConnectionError,
    SlurmConnectionLost,
    SlurmOutputParseError,
    SlurmSubmitError,
)
from hybridflow.utils.capacity import CapacityVerdict, capacity_sinfo_argv, capacity_squeue_argv, capacity_verdict
from hybridflow.utils.efficiency import accounting_settled, efficiency_argv, job_efficiency
from hybridflow.utils.ledger import (
    ledger_jobs_argv,
    node_events_argv,
    parse_ledger_jobs,
    parse_node_events,
    partition_day,
)
from hybridflow.utils.reconcile import (
    CLUSTER_CLOCK_ARGV,
    JobListing,
    parse_cluster_clock,
    parse_user_jobs,
    user_jobs_argv,
)
from hybridflow.utils.slurm import parse_sbatch_parsable, parse_sinfo_gpus, parse_squeue, wait_for_file_argv
from hybridflow.utils.slurm_jobs import (
    SlurmJobStatus,
    job_ids_by_name,
    sacct_argv,
    sacct_by_name_argv,
    scontrol_argv,
    scontrol_says_unknown,
    squeue_by_name_argv,
    status_from_sacct,
    status_from_scontrol,
)


@dataclass(frozen=True)
class RemoteResult:
    returncode: int
    stdout: str
    stderr: str


class SlurmHook(BaseHook):
    """
    Runs Slurm commands on the cluster's login node over the ``ssh`` connection.

    Every command is an argv list, quoted with :func:`shlex.join` (the remote shell re-parses the line), and
    data such as batch scripts goes on stdin. The connection's ``host_key`` extra is the only host key trusted: a
    connection without one, or one that disables the check, is refused before anything is sent (see
    :func:`pinned_host_key`).

    :param ssh_conn_id: Airflow connection of type ``ssh`` to the login node.
    :param conn_retry_attempts: SSH connection attempts before giving up.
    """

    conn_name_attr = "ssh_conn_id"
    default_conn_name = "slurm_ssh"
    conn_type = "ssh"
    hook_name = "Slurm over SSH"
    CHANNEL_OPEN_TIMEOUT_S = 30.0

    def __init__(self, ssh_conn_id: str = default_conn_name, conn_retry_attempts: int = 2, timeout_s: float = 120):
        super().__init__()
        self.ssh_conn_id = ssh_conn_id
        self.conn_retry_attempts = conn_retry_attempts
        self.timeout_s = timeout_s

    @cached_property
    def ssh_hook(self) -> SSHHook:
        # Checked on the extras before the provider's hook is built: it would otherwise fall back to
        # ~/.ssh/known_hosts, or skip the check, without a word.
        pinned_host_key(self.ssh_conn_id, self.get_connection(self.ssh_conn_id).extra_dejson)
        return SSHHook(ssh_conn_id=self.ssh_conn_id, conn_retry_attempts=self.conn_retry_attempts)

    @property
    def endpoint(self) -> str:
        return f"{self.ssh_hook.username}@{self.ssh_hook.remote_host}:{self.ssh_hook.port}"

    def get_conn(self):
        import paramiko

        try:
            client = self.ssh_hook.get_conn()
        except paramiko.BadHostKeyException as exc:
            if _same_key(exc.key, self.ssh_hook.host_key):
                # paramiko checks ~/.ssh/known_hosts before the pin: here the server proved the pinned key.
                entry = _known_hosts_pattern(self.ssh_hook.remote_host, self.ssh_hook.port)
                raise SlurmConnectionError(
                    f"~/.ssh/known_hosts of the Airflow user holds another key for {self.endpoint} than the "
                    f"'host_key' of connection {self.ssh_conn_id!r}, which the server proved it holds; remove that "
                    f"stale entry (ssh-keygen -R '{entry}')"
                ) from exc
            raise SlurmConnectionError(
                f"host key of {self.endpoint} does NOT match the 'host_key' of connection {self.ssh_conn_id!r} "
                f"(got {exc.key.get_name()} {exc.key.get_base64()[:16]}...). Do not connect until you know why: "
                "if the server was re-keyed on purpose, put its new public key in the connection's 'host_key' extra"
            ) from exc
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise SlurmConnectionError(
                    f"host key of {self.endpoint} is unknown; set the 'host_key' extra of connection "
                    f"{self.ssh_conn_id!r} to the login node's public key (ssh-keyscan, verified out of band)"
                ) from exc
            raise SlurmConnectionError(f"SSH to {self.endpoint} failed: {exc}") from exc
        except OSError as exc:
            raise SlurmConnectionError(
                f"cannot reach {self.endpoint}: {exc}; check that the login node's sshd runs and the connection "
                f"{self.ssh_conn_id!r} has the right host and port"
            ) from exc
        self._check_pinned_host_key(client)
        return client

    def _check_pinned_host_key(self, client) -> None:
        """The connection's ``host_key`` is the only key trusted. paramiko prefers ~/.ssh/known_hosts over it, so
        a stale or planted entry there would otherwise win: compare what the server proved it holds, before any
        command runs. No pin at all is refused too (``ssh_hook`` already did; this keeps the check unskippable)."""
        pinned = self.ssh_hook.host_key
        served = client.get_transport().get_remote_server_key()
        if pinned is not None and _same_key(served, pinned):
            return
        client.close()
        self.ssh_hook.client = None
        if pinned is None:
            raise SlurmConnectionError(_no_pin_message(self.ssh_conn_id, "has no 'host_key' extra"))
        raise SlurmConnectionError(
            f"host key of {self.endpoint} does NOT match the 'host_key' of connection {self.ssh_conn_id!r} (server "
            f"proved {served.get_name()} {served.get_base64()[:16]}..., connection pins {pinned.get_name()} "
            f"{pinned.get_base64()[:16]}...). Do not connect until you know why: if the server was re-keyed on "
            "purpose, put its new public key in the 'host_key' extra; if ~/.ssh/known_hosts holds another key for "
            "this host, remove that entry (ssh-keygen -R)"
        )

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout_s: float | None = None) -> RemoteResult:
        """Run one command (argv, quoted here) and return its exit code and output; data goes on stdin."""
        if not argv:
            raise ValueError("argv must name a command")
        channel = self._exec(argv, timeout_s or self.timeout_s)
        with channel:
            if stdin is not None:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            stdout = channel.makefile("rb").read().decode(errors="replace")
            stderr = channel.makefile_stderr("rb").read().decode(errors="replace")
            return RemoteResult(channel.recv_exit_status(), stdout, stderr)

    def _exec(self, argv: Sequence[str], timeout_s: float):
        """A channel running ``argv``. A channel that does not open within :attr:`CHANNEL_OPEN_TIMEOUT_S` on the
        cached connection (one held idle through a deferral once stalled there for the whole command timeout) is
        given up with its connection and opened once more on a fresh one: nothing ran on the first."""
        import paramiko

        for attempt in (1, 2):
            transport = self.get_conn().get_transport()
            try:
                channel = transport.open_session(timeout=self.CHANNEL_OPEN_TIMEOUT_S)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                self.close()
                if attempt == 2:
                    raise SlurmConnectionError(f"SSH to {self.endpoint} opened no channel twice, on a fresh "
                                               f"connection too ({exc}); check the login node's sshd") from exc
                self.log.warning("SSH channel to %s did not open (%s); opening a fresh connection", self.endpoint, exc)
                continue
            channel.settimeout(timeout_s)
            channel.exec_command(shlex.join(argv))
            return channel
        raise AssertionError("unreachable")

    def submit(self, script: str) -> str:
        """sbatch the script (sent on stdin, never on the command line); returns the job id."""
        result = self.run(["sbatch", "--parsable"], stdin=script)
        if result.returncode != 0:
            raise SlurmSubmitError(f"sbatch on {self.endpoint} refused the job: {result.stderr.strip()}")
        return parse_sbatch_parsable(result.stdout)

    def status(self, job_id: str) -> SlurmJobStatus | None:
        """The job's state from the controller, or from accounting once the controller has forgotten it."""
        shown = self.run(scontrol_argv(job_id))
        if shown.returncode == 0:
            return status_from_scontrol(shown.stdout)
        if not scontrol_says_unknown(shown.returncode, shown.stderr):
            raise SlurmConnectionError(f"scontrol on {self.endpoint} failed: {shown.stderr.strip()}")
        return status_from_sacct(self.run(sacct_argv(job_id)).stdout, job_id)

    def find_by_name(self, name: str) -> list[SlurmJobStatus]:
        """Every job with this name that the queue or accounting knows, oldest first."""
        queued = self.run(squeue_by_name_argv(name))
        accounted = self.run(sacct_by_name_argv(name))
        ids = job_ids_by_name(queued.stdout, accounted.stdout, name)
        return [status for status in map(self.status, ids) if status is not None]

    @property
    def job_user(self) -> str:
        """The user the suite's jobs run as: the connection's login, since every job is submitted through it."""
        return self.ssh_hook.username

    def user_jobs(self, user: str | None = None) -> JobListing:
        """Every job of ``user`` (default :attr:`job_user`) that the controller still queues or runs, with the
        cluster's clock read just before (so an age is never overstated). squeue exits 0 for a user it does not
        know: anything it prints on stderr is an error here."""
        user = user or self.job_user
        clock = self.run(list(CLUSTER_CLOCK_ARGV))
        listed = self.run(user_jobs_argv(user))
        if listed.returncode != 0 or listed.stderr.strip():
            raise SlurmConnectionError(f"squeue for user {user!r} on {self.endpoint} failed (exit "
                                       f"{listed.returncode}): {listed.stderr.strip()}")
        jobs, unreadable = parse_user_jobs(listed.stdout)
        return JobListing(user=user, now_s=parse_cluster_clock(clock.stdout), jobs=tuple(jobs),
                          unreadable=tuple(unreadable))

    def cancel(self, job_id: str, wait_s: float = 15) -> SlurmJobStatus | None:
        """scancel, then confirm from the job's state: scancel exits 0 even for jobs it did not touch."""
        self.run(["scancel", job_id])
        deadline = time.monotonic() + wait_s
        status = self.status(job_id)
        while status is not None and not status.final(requeue_enabled=False) and time.monotonic() < deadline:
            time.sleep(0.5)
            status = self.status(job_id)
        return status

    def capacity(self, partition: str, gpus_per_node: int, nodes: int = 1,
                 exclude: Sequence[str] = ()) -> CapacityVerdict:
        """Whether the partition could start a job of this shape now (without the ``exclude`` nodes), and why not."""
        sinfo = self.run(capacity_sinfo_argv(partition))
        pending = self.run(capacity_squeue_argv(partition))
        return capacity_verdict(partition, parse_sinfo_gpus(sinfo.stdout), parse_squeue(pending.stdout),
                                gpus_per_node, nodes, exclude)

    def efficiency(self, job_id: str, settle_s: float = 5) -> dict:
        """The ended job's efficiency from accounting (:func:`job_efficiency`). slurmctld sends slurmdbd a job's
        end a moment after it ends, and a busy slurmdbd may refuse a query: a record without the end, or a sacct
        that failed or printed what does not parse, is read again for up to ``settle_s``; then the last error
        stands."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                text = self._checked(efficiency_argv(job_id), "sacct")
                if accounting_settled(text, job_id) or time.monotonic() >= deadline:
                    return job_efficiency(text, job_id)
            except (SlurmConnectionError, SlurmOutputParseError):
                if time.monotonic() >= deadline:
                    raise
            time.sleep(1)

    def ledger_day(self, partition: str, window: tuple[datetime, datetime],
                   time_splits: Mapping[str, Mapping] | None = None,
                   gpu_busy: Mapping[str, float] | None = None) -> dict:
        """The partition's ledger row for ``window`` (:func:`partition_day`; times in the cluster's local time, as
        sacct reads them), over the nodes the partition has now."""
        nodes = parse_sinfo_gpus(self._checked(capacity_sinfo_argv(partition), "sinfo"))
        node_gpus = {node.name: node.gpus_total for node in nodes}
        jobs = parse_ledger_jobs(self._checked(ledger_jobs_argv(partition, *window), "sacct"))
        events = parse_node_events(self._checked(node_events_argv(node_gpus, *window), "sacctmgr")) if nodes else []
        return partition_day(partition, window, node_gpus, jobs, events, gpu_busy=gpu_busy, time_splits=time_splits)

    def _checked(self, argv: Sequence[str], what: str) -> str:
        result = self.run(argv)
        if result.returncode != 0:
            raise SlurmConnectionError(f"{what} on {self.endpoint} failed (exit {result.returncode}): "
                                       f"{result.stderr.strip()[:500]}")
        return result.stdout

    def wait_for_file(self, path: str, window_s: float) -> bool:
        """Whether ``path`` exists now or appears within ``window_s`` (one command waiting on the login node)."""
        return self.run(wait_for_file_argv(path, window_s), timeout_s=window_s + 60).returncode == 0

    def tail(self, path: str, lines: int = 50) -> str:
        if not path:
            return ""
        result = self.run(["tail", "-n", str(lines), "--", path])
        return result.stdout if result.returncode == 0 else ""

    def write_text(self, path: str, text: str) -> None:
        """Write a file on the cluster's filesystem as the job user; the content goes on stdin."""
        result = self.run(["tee", "--", path], stdin=text)
        if result.returncode != 0:
            raise SlurmConnectionError(f"cannot write {path} on {self.endpoint}: {result.stderr.strip()}")

    def write_private(self, path: str, text: str) -> None:
        """Write a file only the job user can read (a secret): created 0600 before any byte goes in, content on
        stdin (never on a command line)."""
        result = self.run(["sh", "-c", 'umask 077 && rm -f -- "$1" && cat > "$1"', "write_private", path],
                          stdin=text)
        if result.returncode != 0:
            raise SlurmConnectionError(f"cannot write {path} on {self.endpoint}: {result.stderr.strip()}")

    def read_text(self, path: str) -> str | None:
        result = self.run(["cat", "--", path])
        return result.stdout if result.returncode == 0 else None

    def read_bytes(self, path: str) -> bytes | None:
        """A file's bytes (a model), or None when it cannot be read."""
        with self._exec(["cat", "--", path], self.timeout_s) as channel:
            channel.shutdown_write()
            content = channel.makefile("rb").read()
            return content if channel.recv_exit_status() == 0 else None

    def remove(self, path: str) -> None:
        self.run(["rm", "-f", "--", path])

    def close(self) -> None:
        if "ssh_hook" in self.__dict__ and self.ssh_hook.client is not None:
            self.ssh_hook.client.close()
            self.ssh_hook.client = None

    def test_connection(self) -> tuple[bool, str]:
        result = self.run(["sinfo", "--version"])
        return result.returncode == 0, (result.stdout or result.stderr).strip()


class SlurmAsyncHook:
    """
    The trigger side: the same commands and parsers as :class:`SlurmHook`, over one reused asyncssh connection
    from the ssh provider's async hook.

    A lost connection raises :class:`SlurmConnectionLost` (the caller reconnects within its budget); a host key
    that does not verify raises :class:`SlurmConnectionError` and is never retried.
    """

    def __init__(self, ssh_conn_id: str = SlurmHook.default_conn_name):
        self.ssh_conn_id = ssh_conn_id
        self._conn = None

    async def _connection(self):
        if self._conn is None:
            import asyncssh

            try:
                self._conn = await _PinnedSSHHookAsync(ssh_conn_id=self.ssh_conn_id).get_conn()
            except asyncssh.HostKeyNotVerifiable as exc:
                raise SlurmConnectionError(
                    f"host key of the login node of connection {self.ssh_conn_id!r} does NOT match its 'host_key' "
                    f"extra ({exc}). Do not connect until you know why: if the server was re-keyed on purpose, put "
                    "its new public key in the 'host_key' extra"
                ) from exc
            except asyncssh.PermissionDenied as exc:
                raise SlurmConnectionError(
                    f"login to connection {self.ssh_conn_id!r} refused ({exc}); check its user and key file"
                ) from exc
            except (OSError, asyncssh.Error) as exc:
                raise SlurmConnectionLost(f"cannot reach connection {self.ssh_conn_id!r}: {exc}") from exc
        return self._conn

    async def run(self, argv: Sequence[str], stdin: str | None = None, timeout_s: float = 60) -> RemoteResult:
        import asyncssh

        conn = await self._connection()
        try:
            result = await conn.run(shlex.join(argv), input=stdin, check=False, timeout=timeout_s)
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            await self.close()
            raise SlurmConnectionLost(f"SSH command on connection {self.ssh_conn_id!r} failed: {exc}") from exc
        if result.exit_status is None:
            # no exit status: sshd went away mid-command (or the command died of a signal); its output is partial,
            # so this is a lost connection to retry, not an answer (an empty `scontrol show job` is not a job)
            await self.close()
            signal = f" (signal {result.exit_signal[0]})" if result.exit_signal else ""
            raise SlurmConnectionLost(
                f"SSH command on connection {self.ssh_conn_id!r} ended without an exit status{signal}: "
                f"{shlex.join(argv)}"
            )
        return RemoteResult(result.exit_status, str(result.stdout or ""), str(result.stderr or ""))

    async def status(self, job_id: str) -> SlurmJobStatus | None:
        shown = await self.run(scontrol_argv(job_id))
        if shown.returncode == 0:
            return status_from_scontrol(shown.stdout)
        if not scontrol_says_unknown(shown.returncode, shown.stderr):
            raise SlurmConnectionLost(f"scontrol failed: {shown.stderr.strip()}")
        return status_from_sacct((await self.run(sacct_argv(job_id))).stdout, job_id)

    async def wait_for_file(self, path: str, window_s: float) -> bool:
        return (await self.run(wait_for_file_argv(path, window_s), timeout_s=window_s + 60)).returncode == 0

    async def capacity(self, partition: str, gpus_per_node: int, nodes: int = 1) -> CapacityVerdict:
        sinfo = await self.run(capacity_sinfo_argv(partition))
        pending = await self.run(capacity_squeue_argv(partition))
        return capacity_verdict(partition, parse_sinfo_gpus(sinfo.stdout), parse_squeue(pending.stdout),
                                gpus_per_node, nodes)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# Extras with which the ssh provider's hooks skip or loosen host key verification.
_DISABLING_EXTRAS = ("no_host_key_check", "ignore_hostkey_verification", "allow_host_key_change")


def pinned_host_key(conn_id: str, extra: Mapping[str, Any]) -> str:
    """The connection's pinned host key as ``"<type> <base64>"``; raises :class:`SlurmConnectionError` otherwise.

    Both hooks call this before they open a socket: without a pin the ssh provider's hooks trust whatever
    ~/.ssh/known_hosts lists, and the extras in ``_DISABLING_EXTRAS`` or ``known_hosts: none`` skip the check.
    """
    disabling = [f"{name}: true" for name in _DISABLING_EXTRAS if str(extra.get(name, "")).strip().lower() == "true"]
    if str(extra.get("known_hosts", "")).strip().lower() == "none":
        disabling.append("known_hosts: none")
    if disabling:
        raise SlurmConnectionError(
            f"connection {conn_id!r} disables host key verification ({', '.join(disabling)}); remove it from the "
            "extra and set its 'host_key' extra to the login node's public host key"
        )
    host_key = extra.get("host_key")
    parts = host_key.split() if isinstance(host_key, str) else []
    if len(parts) < 2:
        what = "has no 'host_key' extra" if not parts else f"has a 'host_key' extra without key data ({host_key!r})"
        raise SlurmConnectionError(_no_pin_message(conn_id, what))
    return f"{parts[0]} {parts[1]}"


def _no_pin_message(conn_id: str, what: str) -> str:
    return (
        f"connection {conn_id!r} {what}, and nothing else is trusted in its place (not ~/.ssh/known_hosts): set "
        "its 'host_key' extra to the login node's public host key, '<type> <base64>' as in the node's "
        "/etc/ssh/ssh_host_ed25519_key.pub, verified out of band (not just taken from ssh-keyscan)"
    )


def _same_key(a, b) -> bool:
    """Two paramiko keys are the same key (the public blob names the type too)."""
    return a is not None and b is not None and a.asbytes() == b.asbytes()


def _known_hosts_pattern(host: str, port: int) -> str:
    """How OpenSSH names the host in known_hosts: non-22 ports as [host]:port."""
    return host if port == 22 else f"[{host}]:{port}"


def _port_aware_known_hosts(host: str, port: int, host_key: str) -> bytes:
    """One known_hosts line for the connection's host key, matched against its real port."""
    return f"{_known_hosts_pattern(host, port)} {' '.join(host_key.split()[:2])}\n".encode()


class _PinnedSSHHookAsync(SSHHookAsync):
    """The provider's async hook, trusting only the connection's ``host_key``, matched against its real port."""

    async def _get_conn(self):
        # The provider parses no extras for a connection without any, then trusts ~/.ssh/known_hosts: check the
        # pin here, before it connects.
        conn = await get_async_connection(self.ssh_conn_id)
        pinned_host_key(self.ssh_conn_id, conn.extra_dejson)
        return await super()._get_conn()

    def _parse_extras(self, conn) -> None:
        host_key = pinned_host_key(self.ssh_conn_id, conn.extra_dejson)
        super()._parse_extras(conn)
        # Whatever the extras chose (a known_hosts file, the host without its port), the pin alone is trusted.
        self.known_hosts = _port_aware_known_hosts(self.host or conn.host, self.port or conn.port or 22, host_key)
