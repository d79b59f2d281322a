"""Slurm over SSH: the ssh provider's hook for the connection, with host keys always verified."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from airflow.sdk import BaseHook

from hybridflow.exceptions import SlurmConnectionError


@dataclass(frozen=True)
class RemoteResult:
    returncode: int
    stdout: str
    stderr: str


class SlurmHook(BaseHook):
    """
    Runs Slurm commands on the cluster's login node over the ``ssh`` connection.

    Every command is an argv list, quoted with :func:`shlex.join` (the remote shell re-parses the line), and
    data such as batch scripts goes on stdin. Host keys are verified against the connection's ``host_key``
    extra; a connection that disables the check is refused.

    :param ssh_conn_id: Airflow connection of type ``ssh`` to the login node.
    :param conn_retry_attempts: SSH connection attempts before giving up.
    """

    conn_name_attr = "ssh_conn_id"
    default_conn_name = "slurm_ssh"
    conn_type = "ssh"
    hook_name = "Slurm over SSH"

    def __init__(self, ssh_conn_id: str = default_conn_name, conn_retry_attempts: int = 2, timeout_s: float = 120):
        super().__init__()
        self.ssh_conn_id = ssh_conn_id
        self.conn_retry_attempts = conn_retry_attempts
        self.timeout_s = timeout_s

    @cached_property
    def ssh_hook(self):
        from airflow.providers.ssh.hooks.ssh import SSHHook

        hook = SSHHook(ssh_conn_id=self.ssh_conn_id, conn_retry_attempts=self.conn_retry_attempts)
        if hook.no_host_key_check or hook.allow_host_key_change:
            raise SlurmConnectionError(
                f"connection {self.ssh_conn_id!r} disables host key verification; remove 'no_host_key_check' and "
                "'allow_host_key_change' from its extra and set 'host_key' to the login node's public host key"
            )
        return hook

    @property
    def endpoint(self) -> str:
        return f"{self.ssh_hook.username}@{self.ssh_hook.remote_host}:{self.ssh_hook.port}"

    def get_conn(self):
        import paramiko

        try:
            return self.ssh_hook.get_conn()
        except paramiko.BadHostKeyException as exc:
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

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout_s: float | None = None) -> RemoteResult:
        """Run one command (argv, quoted here) and return its exit code and output; data goes on stdin."""
        if not argv:
            raise ValueError("argv must name a command")
        client = self.get_conn()
        stdin_f, stdout_f, stderr_f = client.exec_command(shlex.join(argv), timeout=timeout_s or self.timeout_s)
        if stdin is not None:
            stdin_f.write(stdin)
        stdin_f.channel.shutdown_write()
        stdout = stdout_f.read().decode(errors="replace")
        stderr = stderr_f.read().decode(errors="replace")
        return RemoteResult(stdout_f.channel.recv_exit_status(), stdout, stderr)

    def close(self) -> None:
        if "ssh_hook" in self.__dict__ and self.ssh_hook.client is not None:
            self.ssh_hook.client.close()
            self.ssh_hook.client = None

    def test_connection(self) -> tuple[bool, str]:
        result = self.run(["sinfo", "--version"])
        return result.returncode == 0, (result.stdout or result.stderr).strip()
