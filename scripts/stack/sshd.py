"""The cluster's login: an sshd of its own on loopback, key-only, for the job user only."""

from __future__ import annotations

import socket
from pathlib import Path

from .common import (
    JOB_USER,
    STACK,
    P,
    Service,
    ensure_dir,
    port_open,
    run,
    wait_pidfile,
    write_if_changed,
)


def ensure_host_key() -> str:
    ensure_dir(P.sshd, mode=0o755)
    key = P.sshd / "ssh_host_ed25519_key"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
    key_type, key_data = (P.sshd / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    return f"{key_type} {key_data}"


def sshd_conf() -> str:
    return f"""# Written by scripts/localstack.py: loopback only, key-only, the job user only.
Port {STACK['ssh_port']}
ListenAddress 127.0.0.1
HostKey {P.sshd}/ssh_host_ed25519_key
PidFile {P.sshd}/sshd.pid
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
AllowUsers {JOB_USER}
AuthorizedKeysFile .ssh/authorized_keys
X11Forwarding no
AllowTcpForwarding no
PermitTunnel no
MaxStartups 64:30:128
MaxSessions 64
Subsystem sftp internal-sftp
"""


def sshd_ready() -> bool:
    if not port_open(STACK["ssh_port"]):
        return False
    with socket.create_connection(("127.0.0.1", STACK["ssh_port"]), timeout=2) as sock:
        return sock.recv(64).startswith(b"SSH-2.0")


def start_sshd() -> int:
    ensure_host_key()
    conf = P.sshd / "sshd_config"
    write_if_changed(conf, sshd_conf())
    ensure_dir(Path("/run/sshd"))
    check = run(["/usr/sbin/sshd", "-t", "-f", str(conf)], check=False)
    if check.returncode:
        raise RuntimeError(f"sshd config {conf} is invalid: {check.stderr.strip()}")
    run(["/usr/sbin/sshd", "-f", str(conf)])
    return wait_pidfile(P.sshd / "sshd.pid")


def services() -> list[Service]:
    return [Service("sshd", sshd_ready, start_sshd, comm="sshd",
                    endpoint=f"ssh://{JOB_USER}@127.0.0.1:{STACK['ssh_port']}")]
