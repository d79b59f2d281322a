#!/usr/bin/env python3
"""Bring the local stack of real services up and down on 127.0.0.1, without systemd.

    python3 scripts/localstack.py up [SERVICE ...]   start what is not running (idempotent)
    python3 scripts/localstack.py down                stop what this checkout started, by PID
    python3 scripts/localstack.py status [--json]     one line per service; exit 1 if any is down
    python3 scripts/localstack.py env                 shell exports for Airflow and the tests

The cluster side (munge, MariaDB, slurmdbd, slurmctld, one slurmd per node, sshd and the shared storage) lives under the
profile's `cluster_dir` (default /var/lib/hybridflow) because the daemons' users (slurm, mysql, munge, the job
user) must traverse it; the Airflow side (Airflow home, Spark standalone, Triton, the S3 endpoint, MLflow's
config, generated keys, PID files) lives under `.state/` in the checkout. Standard library only: it runs before
any venv exists.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import grp
import hashlib
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from string import Template

import mlflowstack  # scripts/ is on sys.path: this script's own folder
import pgstack

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state")).resolve()
PROFILE = Path(os.environ.get("HYBRIDFLOW_PROFILE", REPO / "include/profiles/local.json")).resolve()
VENV = REPO / ".venv"
SERVING_VENV = REPO / ".venv-serving"
MLFLOW_VENV = REPO / ".venv-mlflow"

APT_PACKAGES = [
    "munge", "slurmctld", "slurmd", "slurm-client", "slurmdbd", "mariadb-server", "openssh-server", "openssh-client",
    "python3-venv",
    "acl",  # setfacl: a traverse-only entry for the service user on a checkout under a closed directory
    *pgstack.APT_PACKAGES,  # Airflow's metadata database
    "chromium", "chromium-driver",  # the real-browser tests of the Airflow UI (tests/browser)
]
REQUIRED_BINARIES = ["munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "mariadbd", "mariadb-install-db",
                     "sshd", "setfacl", *pgstack.REQUIRED_BINARIES, "chromium", "chromedriver"]
CLUSTER_PYTHON = "/usr/bin/python3"  # the cluster's own interpreter, not this checkout's (maybe under /root)


T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[localstack {time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=True, **kw)


# ---------------------------------------------------------------------------------------------- profile & paths
@dataclass(frozen=True)
class Paths:
    cluster: Path

    @property
    def slurm(self) -> Path:
        return self.cluster / "slurm"

    @property
    def mariadb(self) -> Path:
        return self.cluster / "mariadb"

    @property
    def sshd(self) -> Path:
        return self.cluster / "sshd"

    @property
    def gres(self) -> Path:
        return self.cluster / "gres"

    @property
    def storage(self) -> Path:
        """Shared storage seen by Airflow, Spark, the Slurm jobs (over SSH) and Triton."""
        return self.cluster / "storage"

    @property
    def postgres(self) -> Path:
        """This checkout's PostgreSQL cluster (Airflow's metadata): under cluster_dir, where the postgres user
        can reach it, one per checkout (as the SQLite file was) so two clones never share runs."""
        checkout = hashlib.sha256(str(STATE).encode()).hexdigest()[:12]
        return self.cluster / "postgres" / checkout

    @property
    def cluster_venv(self) -> Path:
        return self.cluster / "cluster-venv"

    @property
    def node_scratch(self) -> Path:
        """Each Slurm node's local scratch (``<this>/<node>``), which the node self-check probes."""
        return self.cluster / "scratch"

    @property
    def cluster_code(self) -> Path:
        return self.cluster / "code"

    @property
    def cluster_secrets(self) -> Path:
        return self.cluster / "secrets"

    # Airflow side, per checkout
    run_dir = STATE / "run"
    logs = STATE / "logs"
    ssh_client = STATE / "ssh"
    airflow_home = STATE / "airflow"
    spark = STATE / "spark"
    triton = STATE / "triton"
    mlflow = STATE / "mlflow"  # the MLflow server's config and home: its user's, 0700
    local_secrets = STATE / "secrets"


def load_profile() -> dict:
    try:
        return json.loads(PROFILE.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        sys.exit(f"cannot read profile {PROFILE}: {exc}")


PROF = load_profile()
STACK = PROF["stack"]
P = Paths(Path(STACK["cluster_dir"]))
JOB_USER = STACK["job_user"]
# Airflow's components (and so every task and task-launched Spark driver) and Spark's daemons run as this
# unprivileged user; it and the job user share the storage group, the one door between the two sides.
SERVICE_USER = STACK.get("service_user", "hybridflow")
STORAGE_GROUP = STACK.get("storage_group", SERVICE_USER)
# Files the services and the jobs create in the shared storage stay writable by the group.
SHARED_UMASK = 0o002
SERVICE_USER_SERVICES = ("airflow-", "spark-")
# The MLflow server runs as a user of its own: Airflow's tasks (the service user) cannot read its auth store, its
# admin password or its database password; Airflow logs in to it as an ordinary MLflow user.
MLFLOW_USER = STACK.get("mlflow_user", "mlflow")
MLFLOW_CLIENT_USER = "airflow"
MLFLOW_LOGIN = pgstack.Login("mlflow", "mlflow", "postgres-mlflow")  # its role and database in PostgreSQL
# Every ensure_cluster call names the same logins: pg_hba.conf admits only those.
POSTGRES_MORE_LOGINS = [MLFLOW_LOGIN]
# Airflow's metadata database: PostgreSQL (the default), or SQLite in the Airflow home when asked for
# (HYBRIDFLOW_METADATA_DB=sqlite, or the profile's `metadata_db`): fine for trying it out, not for load.
METADATA_DB = os.environ.get("HYBRIDFLOW_METADATA_DB", STACK.get("metadata_db", "postgres"))
if METADATA_DB not in ("postgres", "sqlite"):
    sys.exit(f"HYBRIDFLOW_METADATA_DB / profile metadata_db must be 'postgres' or 'sqlite', not {METADATA_DB!r}")

NODE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def slurm_nodes(stack: dict) -> list[str]:
    """The Slurm nodes this machine runs, one slurmd each. A profile written for the one-node versions (a single
    `slurm_node`) still works."""
    nodes = stack["slurm_nodes"] if "slurm_nodes" in stack else [stack.get("slurm_node")]
    if (not isinstance(nodes, list) or not nodes or len(set(nodes)) != len(nodes)
            or not all(isinstance(n, str) and NODE_NAME.fullmatch(n) for n in nodes)):
        sys.exit(f"profile {PROFILE}: stack.slurm_nodes must be a non-empty list of distinct node names "
                 f"(letters, digits, '-', '_', '.'), not {nodes!r}")
    return nodes


SLURM_NODES = slurm_nodes(STACK)
# Several slurmd on one machine need a port each: the first node listens on this one, the next on +1, ...
SLURMD_BASE_PORT = 16821


def slurmd_port(node: str) -> int:
    return SLURMD_BASE_PORT + SLURM_NODES.index(node)


def write_new_file(path: Path, text: str, mode: int) -> None:
    """Write ``path`` (through a temporary file, replaced at once) with ``mode`` from its first byte: a secret
    is never readable by others, not even between creation and a chmod."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode is masked by the umask; the file exists only with our mode anyway
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    tmp.replace(path)


def secret(name: str, where: Path, nbytes: int = 24, make: Callable[[int], str] = secrets.token_urlsafe) -> str:
    """A generated secret, created once in a 0600 file in a 0700 directory (never in the repo)."""
    path = where / name
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_new_file(path, make(nbytes), 0o600)
    return path.read_text().strip()


def chown(path: Path, user: str, group: str | None = None) -> None:
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, grp.getgrnam(group).gr_gid if group else pw.pw_gid)


def ensure_dir(path: Path, owner: str = "root", mode: int = 0o755, group: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    chown(path, owner, group)
    path.chmod(mode)  # after chown: a chown clears the setgid bit
    return path


def write_if_changed(path: Path, text: str, mode: int = 0o644, owner: str = "root") -> bool:
    changed = not path.exists() or path.read_text() != text
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_new_file(path, text, mode)
    path.chmod(mode)
    chown(path, owner)
    return changed


# ---------------------------------------------------------------------------------------------- processes
def pid_alive(pid: int) -> bool:
    """True for a live process; a zombie (PID 1 here reaps late) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str, timeout_s: float = 5) -> bool:
    # Generous: on 2 busy cores a healthy server can take seconds to answer.
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except OSError:
        return False


def wait_for(what: str, check: Callable[[], bool], timeout: float, logfile: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.1
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    hint = f"; see {logfile}" if logfile else ""
    raise RuntimeError(f"{what} did not become ready within {timeout:.0f} s{hint}")


@dataclass
class Service:
    """One process of the stack: how to start it, how to tell it is ready, where its PID is."""

    name: str
    ready: Callable[[], bool]
    start: Callable[[], int | None]
    # Daemons that fork write their own pid file; for the rest the PID is the child we spawned.
    timeout: float = 60
    endpoint: str = ""
    logfile: Path | None = None
    comm: str = ""  # expected /proc/PID/comm prefix, so a recycled PID is never signalled
    extra: dict = field(default_factory=dict)

    @property
    def pidfile(self) -> Path:
        return P.run_dir / f"{self.name}.pid"

    def owned_pid(self) -> int | None:
        pid = read_pid(self.pidfile)
        if pid is None or not pid_alive(pid):
            return None
        if self.comm:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                return None
            if not comm.startswith(self.comm[:15]):
                return None
        return pid


def as_user(user: str, env: dict | None = None, umask: int = 0o077, home: Path | None = None) -> dict:
    """Popen arguments that run a process as an unprivileged user, with its groups, its home (or `home`) and
    `umask` (root opens the log file first and hands the process the open descriptor)."""
    pw = pwd.getpwnam(user)
    names = {"HOME": str(home or pw.pw_dir), "USER": user, "LOGNAME": user}
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(user, pw.pw_gid),
            "umask": umask, "env": dict(env if env is not None else os.environ, **names)}


def as_service_user(env: dict | None = None) -> dict:
    """Popen arguments that run a process as the service user, with the shared umask."""
    return as_user(SERVICE_USER, env, SHARED_UMASK)


def spawn(cmd: list[str], logfile: Path, env: dict | None = None, cwd: Path | None = None,
          service_user: bool = False, identity: dict | None = None) -> int:
    """Start a foreground-style process in its own session, so `down` can stop it and its children. `identity`
    (from as_user) runs it as another user."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    identity = identity or (as_service_user(env) if service_user else {"env": env})
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
            start_new_session=True, **identity,
        )
    return proc.pid


def wait_pidfile(path: Path, timeout: float = 15) -> int:
    wait_for(f"pid file {path}", lambda: read_pid(path) is not None and pid_alive(read_pid(path)), timeout)
    return read_pid(path)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- system set-up
def ensure_packages() -> None:
    missing = [b for b in REQUIRED_BINARIES if not shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    if not missing:
        return
    log(f"installing Debian packages (missing: {', '.join(missing)})")
    # Package scripts must not start daemons: we run our own, on loopback, with our config.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )
    finally:
        if made_policy:
            policy.unlink()


def ensure_job_user() -> None:
    try:
        pwd.getpwnam(JOB_USER)
    except KeyError:
        log(f"creating job user {JOB_USER}")
        run(["useradd", "--create-home", "--shell", "/bin/bash", JOB_USER])
    # useradd leaves the password field '!' (locked); with UsePAM no, sshd refuses even keys for locked users.
    run(["usermod", "-p", "*", JOB_USER])


def ensure_state_dir() -> None:
    """`.state` is root's, 0710 with the service user's group: that user may pass through to its own Airflow
    home, SSH key and Spark folders (each 0700 its own); no one else may enter, and no one but root may list."""
    ensure_dir(STATE, mode=0o710, group=STORAGE_GROUP)


def ensure_service_user() -> None:
    """The unprivileged user Airflow and Spark run as, and the storage group it shares with the job user."""
    try:
        grp.getgrnam(STORAGE_GROUP)
    except KeyError:
        log(f"creating storage group {STORAGE_GROUP}")
        run(["groupadd", "--system", STORAGE_GROUP])
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        log(f"creating service user {SERVICE_USER}")
        run(["useradd", "--system", "--create-home", "--home-dir", f"/home/{SERVICE_USER}", "--shell",
             "/usr/sbin/nologin", "--gid", STORAGE_GROUP, SERVICE_USER])
    for user in (SERVICE_USER, JOB_USER):
        if user not in grp.getgrnam(STORAGE_GROUP).gr_mem and pwd.getpwnam(user).pw_gid != grp.getgrnam(
                STORAGE_GROUP).gr_gid:
            run(["usermod", "--append", "--groups", STORAGE_GROUP, user])


def ensure_mlflow_user() -> None:
    """The MLflow server's own system user (no login, no home of its own: it lives in .state/mlflow)."""
    try:
        pwd.getpwnam(MLFLOW_USER)
    except KeyError:
        log(f"creating the MLflow server's user {MLFLOW_USER}")
        run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
             "/usr/sbin/nologin", MLFLOW_USER])


def ensure_checkout_reachable(user: str = SERVICE_USER, venv: Path = VENV, probe_dir: Path = REPO / "dags") -> None:
    """The service user runs this checkout's DAGs, plugins and venv (MLflow's user its venv and scripts/): every
    directory above it must let that user pass. A clone under a private directory (/root) gets a traverse-only
    ACL entry for the user, nothing more."""
    python = venv / "bin/python"
    if not python.exists():
        raise RuntimeError(f"no venv at {venv}: run `make venv` (or `make up`) first")
    probe = [str(python), "-c", "import os, sys; os.listdir(sys.argv[1])", str(probe_dir)]
    if run(probe, check=False, **as_user(user)).returncode == 0:
        return
    for parent in reversed(REPO.parents):
        if not parent.stat().st_mode & 0o001:
            if not shutil.which("setfacl"):
                raise RuntimeError(f"{user} cannot reach {REPO}: {parent} is closed to others; "
                                   f"clone elsewhere (e.g. /srv) or apt-get install acl")
            log(f"letting {user} traverse {parent} (ACL u:{user}:--x)")
            run(["setfacl", "-m", f"u:{user}:x", str(parent)])
    done = run(probe, check=False, **as_user(user))
    if done.returncode != 0:
        raise RuntimeError(f"{user} cannot run {python} on {probe_dir}: {done.stderr.strip()}"
                           "; the venv must come from an interpreter outside /root (make venv uses /usr/bin/python3)")


def give_to_service_user(*paths: Path) -> None:
    """Hand what Airflow writes to the service user (once: trees an older root-run stack left behind)."""
    pw = pwd.getpwnam(SERVICE_USER)
    for path in paths:
        if path.exists() and any(p.stat().st_uid != pw.pw_uid for p in (path, *path.iterdir())):
            run(["chown", "-R", f"{SERVICE_USER}:{pw.pw_gid}", str(path)])


def ensure_client_key() -> Path:
    """Airflow's SSH identity, generated here (never committed), readable by the service user only and
    authorized for the job user."""
    ensure_dir(P.ssh_client, owner=SERVICE_USER, mode=0o700)
    key = P.ssh_client / "id_ed25519"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hybridflow-airflow@{REPO.name}", "-f", str(key)])
    give_to_service_user(P.ssh_client)
    pub = (P.ssh_client / "id_ed25519.pub").read_text().strip()
    home = Path(pwd.getpwnam(JOB_USER).pw_dir)
    ssh_dir = ensure_dir(home / ".ssh", owner=JOB_USER, mode=0o700)
    auth = ssh_dir / "authorized_keys"
    lines = auth.read_text().splitlines() if auth.exists() else []
    if pub not in lines:
        lines.append(pub)
    write_if_changed(auth, "\n".join(lines) + "\n", mode=0o600, owner=JOB_USER)
    return key


def ensure_host_key() -> str:
    ensure_dir(P.sshd, mode=0o755)
    key = P.sshd / "ssh_host_ed25519_key"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
    key_type, key_data = (P.sshd / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    return f"{key_type} {key_data}"


def ensure_storage() -> None:
    ensure_dir(P.cluster)
    # The job user writes checkpoints and training outputs; Airflow's service user writes features, models and
    # reports. Both are in the storage group: directories are setgid 2775 (new entries keep the group) and both
    # sides create with umask 002, so either may replace what the other wrote; others may only read.
    ensure_dir(P.storage, owner=JOB_USER, group=STORAGE_GROUP, mode=0o2775)
    for sub in ("checkpoints", "runs", "scratch"):
        ensure_dir(P.storage / sub, owner=JOB_USER, group=STORAGE_GROUP, mode=0o2775)
    for sub in ("features", "raw", "predictions", "models", "model-repository", "reports", "alerts", "utilization"):
        ensure_dir(P.storage / sub, owner=SERVICE_USER, group=STORAGE_GROUP, mode=0o2775)
    stamp = P.storage / ".storage-group"
    if not stamp.exists() or stamp.read_text().strip() != STORAGE_GROUP:
        # Once, for a store that a root-run stack filled: the group, group write, setgid directories.
        log(f"sharing {P.storage} with group {STORAGE_GROUP} (once)")
        run(["chgrp", "-R", STORAGE_GROUP, str(P.storage)])
        run(["chmod", "-R", "g+rwX", str(P.storage)])
        run(["find", str(P.storage), "-type", "d", "-exec", "chmod", "g+s", "{}", "+"])
        stamp.write_text(f"{STORAGE_GROUP}\n")


def ensure_cluster_env() -> None:
    """The job environment on the cluster: a venv from Debian's python3 with include/cluster/requirements.txt."""
    requirements = REPO / "include/cluster/requirements.txt"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = P.cluster_venv / ".installed"
    if stamp.exists() and stamp.read_text() == digest:
        return
    if not Path(CLUSTER_PYTHON).exists() or run([CLUSTER_PYTHON, "-c", "import ensurepip"], check=False).returncode:
        raise RuntimeError(f"{CLUSTER_PYTHON} with the venv module is needed for the cluster's job environment; "
                           "apt-get install python3-venv")
    log(f"building the cluster job environment {P.cluster_venv} (once; ~1-2 min)")
    subprocess.run([CLUSTER_PYTHON, "-m", "venv", str(P.cluster_venv)], check=True)
    subprocess.run([str(P.cluster_venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-r", str(requirements)], check=True)
    stamp.write_text(digest)


CLUSTER_RELEASE = ("jobs", "include/config", "include/deepspeed")


def deploy_jobs() -> None:
    """Ship jobs/ and the configs they read to the cluster's filesystem, as a release would."""
    for part in CLUSTER_RELEASE:
        target = P.cluster_code / part
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(REPO / part, staging, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


# ---------------------------------------------------------------------------------------------- munge
def munge_ready() -> bool:
    if shutil.which("munge") is None:
        return False  # not installed yet (`status` on a fresh machine)
    enc = subprocess.run(["munge", "-n"], capture_output=True)
    if enc.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=enc.stdout, capture_output=True).returncode == 0


def start_munge() -> int:
    ensure_dir(Path("/run/munge"), owner="munge", mode=0o755)
    run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
    return wait_pidfile(Path("/run/munge/munged.pid"))


# ---------------------------------------------------------------------------------------------- mariadb
def mariadb_socket() -> Path:
    return P.mariadb / "run" / "mysqld.sock"


def mariadb_ready() -> bool:
    return port_open(STACK["mariadb_port"]) and mariadb_socket().exists()


def start_mariadb() -> int:
    data = P.mariadb / "data"
    ensure_dir(P.mariadb, owner="mysql")
    ensure_dir(P.mariadb / "run", owner="mysql")
    if not (data / "mysql").exists():
        ensure_dir(data, owner="mysql", mode=0o750)
        log("initialising the private MariaDB for Slurm accounting")
        run(["mariadb-install-db", "--no-defaults", "--user=mysql", f"--datadir={data}",
             "--auth-root-authentication-method=socket", "--skip-test-db"])
    pid = spawn(
        ["mariadbd", "--no-defaults", "--user=mysql", f"--datadir={data}", "--bind-address=127.0.0.1",
         f"--port={STACK['mariadb_port']}", f"--socket={mariadb_socket()}",
         f"--pid-file={P.mariadb / 'run' / 'mariadbd.pid'}", "--innodb-buffer-pool-size=1G",
         "--innodb-lock-wait-timeout=900",
         "--skip-name-resolve"],
        P.logs / "mariadb.log",
    )
    wait_for("MariaDB", mariadb_ready, 60, P.logs / "mariadb.log")
    password = secret("mariadb-slurm", P.cluster_secrets)
    sql = "".join(
        f"CREATE USER IF NOT EXISTS 'slurm'@'{host}' IDENTIFIED BY '{password}';"
        f"ALTER USER 'slurm'@'{host}' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{host}';"
        for host in ("127.0.0.1", "localhost")
    )
    # The SQL goes on stdin, so the password never appears in a process list.
    subprocess.run(["mariadb", "--no-defaults", f"--socket={mariadb_socket()}", "-u", "root"],
                   input=sql, text=True, check=True, capture_output=True)
    return pid


# ---------------------------------------------------------------------------------------------- slurm
def slurm_conf() -> str:
    s, sd = STACK, P.slurm
    hostname = socket.gethostname().split('.')[0]
    # Every node is a slurmd of its own on this machine (multiple-slurmd support): same address, own port.
    nodes = "\n".join(
        f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={hostname} Port={slurmd_port(n)} "
        f"CPUs={s['slurm_node_cpus']} RealMemory={s['slurm_node_memory_mb']} "
        f"Gres=gpu:{s['slurm_gpu_type']}:{s['slurm_gpus']} State=UNKNOWN"
        for n in SLURM_NODES
    )
    node_list = ",".join(SLURM_NODES)
    return f"""# Written by scripts/localstack.py; edit include/profiles/local.json instead.
ClusterName={s['slurm_cluster_name']}
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
# Also the delay before a requeued job is eligible again (default 120 s).
AuthInfo=cred_expire=10
# Bind slurmctld and slurmd to their configured 127.0.0.1 instead of every address.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation={sd}/ctld
# %n is the node name: each slurmd on this machine keeps its own spool, pid file and log.
SlurmdSpoolDir={sd}/d/%n
SlurmctldPidFile={sd}/run/slurmctld.pid
SlurmdPidFile={sd}/run/slurmd-%n.pid
SlurmctldLogFile={sd}/log/slurmctld.log
SlurmdLogFile={sd}/log/slurmd-%n.log
# No cgroups here: track processes by /proc and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# A node whose slurmd stops answering is DOWN after this long (default 300 s): its jobs end NODE_FAIL and a
# --requeue job starts again on the nodes that are up (tests/integration/test_training_heals_itself.py).
SlurmdTimeout=30
# Lets each node advertise the CPUs and GPUs of a GPU node on a 2-core machine.
SlurmdParameters=config_overrides
MinJobAge=300
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStorageTRES=gres/gpu
# Per-step CPU time and MaxRSS for job efficiency (issue 25); linux reads /proc, so it needs no cgroups. MaxRSS
# is sampled: a step shorter than the period has none.
JobAcctGatherType=jobacct_gather/linux
# Keep each job's comment (the suite's job key) in accounting: the ledger's split by DAG and task reads it there.
AccountingStoreFlags=job_comment
JobAcctGatherFrequency=task=2
{nodes}
PartitionName=cpu Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu-training Nodes={node_list} MaxTime=INFINITE State=UP
"""


def gres_dir(node: str) -> Path:
    """The node's GPU device files: every node has its own set."""
    return P.gres / node


def gres_conf() -> str:
    last = STACK["slurm_gpus"] - 1
    return "".join(f"NodeName={n} Name=gpu Type={STACK['slurm_gpu_type']} File={gres_dir(n)}/gpu[0-{last}]\n"
                   for n in SLURM_NODES)


def slurmdbd_conf() -> str:
    sd = P.slurm
    return f"""AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=slurm
PidFile={sd}/run/slurmdbd.pid
LogFile={sd}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={STACK['mariadb_port']}
StorageUser=slurm
StoragePass={secret('mariadb-slurm', P.cluster_secrets)}
StorageLoc=slurm_acct_db
"""


HOSTS_MARKER = "# hybridflow: the local Slurm nodes"


def hosts_with_nodes(hosts: str, nodes: list[str]) -> str:
    """/etc/hosts with one line naming every local Slurm node at 127.0.0.1 (replacing an earlier such line).

    A distributed job rendezvous at its first node's name (MASTER_ADDR), as on a real cluster where node names
    resolve; here they are all this machine.
    """
    kept = [line for line in hosts.splitlines() if not line.endswith(HOSTS_MARKER)]
    return "\n".join([*kept, f"127.0.0.1 {' '.join(nodes)} {HOSTS_MARKER}"]) + "\n"


def resolve_node_names() -> None:
    hosts = Path("/etc/hosts")
    current = hosts.read_text() if hosts.exists() else ""
    wanted = hosts_with_nodes(current, SLURM_NODES)
    if wanted != current:
        # Written in place: /etc/hosts is often a bind mount, which a rename cannot replace.
        hosts.write_text(wanted)


def configure_slurm() -> tuple[str, bool]:
    """Write the Slurm configs; returns the digest of what slurmctld and slurmd read, and whether it changed."""
    for sub in ("", "ctld", "d", "run", "log"):
        ensure_dir(P.slurm / sub, owner="slurm")
    ensure_dir(P.gres)
    ensure_dir(P.node_scratch)
    for node in SLURM_NODES:
        ensure_dir(P.slurm / "d" / node, owner="slurm")
        ensure_dir(P.node_scratch / node, owner=JOB_USER, mode=0o700)
        # GPUs declared as GRES need device files; /dev/null's numbers make harmless ones (shared/notes).
        ensure_dir(gres_dir(node))
        for i in range(STACK["slurm_gpus"]):
            dev = gres_dir(node) / f"gpu{i}"
            if not dev.exists():
                run(["mknod", "-m", "0666", str(dev), "c", "1", "3"])
    resolve_node_names()
    etc = Path("/etc/slurm")
    slurm, gres = slurm_conf(), gres_conf()
    changed = write_if_changed(etc / "slurm.conf", slurm)
    changed = write_if_changed(etc / "gres.conf", gres) or changed
    # slurmdbd refuses a config readable by others, or not owned by SlurmUser.
    write_if_changed(etc / "slurmdbd.conf", slurmdbd_conf(), mode=0o600, owner="slurm")
    return hashlib.sha256((slurm + gres).encode()).hexdigest(), changed


def proc_uid(pid: int) -> int | None:
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def proc_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def slurm_daemons() -> dict[Path, int]:
    """The live slurmctld and slurmd processes, by the pid files Slurm writes: every node's, also one no longer
    configured and the one-node `slurmd.pid` of older versions."""
    run_dir = P.slurm / "run"
    found = {}
    for path in [run_dir / "slurmctld.pid", *sorted(run_dir.glob("slurmd*.pid"))]:
        comm = "slurmctld" if path.name == "slurmctld.pid" else "slurmd"
        if comm == "slurmd" and not (path.name == "slurmd.pid" or path.name.startswith("slurmd-")):
            continue  # slurmdbd.pid
        pid = read_pid(path)
        if pid is not None and pid_alive(pid) and proc_comm(pid) == comm:
            found[path] = pid
    return found


SLURM_CONF_STAMP = P.slurm / "run" / "daemons-conf.sha256"


def reconcile_slurm_config() -> bool:
    """Write the Slurm configs; stop the running slurmctld and slurmd if they read other ones, so that this `up`
    starts them again on the new files. slurmctld 22.05 needs a restart for a changed node set, and a slurmd reads
    its node's line and gres.conf only at start. True when daemons were stopped."""
    digest, changed = configure_slurm()
    running = slurm_daemons()
    # The stamp is the config every running daemon was started with; no stamp: started by an older version.
    stale = not SLURM_CONF_STAMP.exists() or SLURM_CONF_STAMP.read_text().strip() != digest
    if running and (changed or stale):
        log(f"Slurm configuration changed; restarting {', '.join(p.name[:-4] for p in running)}")
        # The slurmds first, the controller last: no node reports to a controller that is going away.
        for path, pid in sorted(running.items(), key=lambda item: item[0].name == "slurmctld.pid"):
            stop_pid(path.name[:-4], pid, group=False)  # not its group: running job steps survive
            if not pid_alive(pid):
                path.unlink(missing_ok=True)
    SLURM_CONF_STAMP.write_text(digest + "\n")
    # This checkout's pid file from the one-node versions names no service any more.
    legacy = LEGACY_SLURMD.owned_pid()
    if legacy is None:
        LEGACY_SLURMD.pidfile.unlink(missing_ok=True)
    return bool(running) and (changed or stale)


def slurmdbd_ready() -> bool:
    return port_open(6819)


def start_slurmdbd() -> int:
    configure_slurm()
    run(["/usr/sbin/slurmdbd"])
    return wait_pidfile(P.slurm / "run" / "slurmdbd.pid")


def slurmctld_ready() -> bool:
    if shutil.which("scontrol") is None:
        return False  # Slurm not installed yet
    out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return out.returncode == 0 and "UP" in out.stdout


def start_slurmctld() -> int:
    configure_slurm()
    run(["/usr/sbin/slurmctld"])
    return wait_pidfile(P.slurm / "run" / "slurmctld.pid")


def node_state(node: str) -> str:
    if shutil.which("sinfo") is None:
        return ""
    out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def node_registered(node: str) -> bool:
    """slurmctld has heard from the node's slurmd (sinfo marks a node it has not with ``*``, or unknown)."""
    state = node_state(node)
    return bool(state) and not state.endswith("*") and "unknown" not in state and "not_responding" not in state


def slurmd_pidfile(node: str) -> Path:
    return P.slurm / "run" / f"slurmd-{node}.pid"  # SlurmdPidFile's %n


def slurmd_pid(node: str) -> int | None:
    pid = read_pid(slurmd_pidfile(node))
    return pid if pid is not None and pid_alive(pid) and proc_comm(pid) == "slurmd" else None


def slurmd_ready(node: str) -> Callable[[], bool]:
    def ready() -> bool:
        # slurmctld keeps showing a node idle for minutes after its slurmd died: the process must be there too.
        if slurmd_pid(node) is None:
            return False
        state = node_state(node)
        return bool(state) and not any(bad in state for bad in ("down", "drain", "unknown", "not_responding"))

    return ready


def start_slurmd(node: str) -> int:
    configure_slurm()
    old = slurmd_pid(node)
    if old is not None:  # alive but its node is not usable (drained, down): start it afresh
        stop_pid(f"slurmd-{node}", old, group=False)
    slurmd_pidfile(node).unlink(missing_ok=True)
    run(["/usr/sbin/slurmd", "-N", node])
    pid = wait_pidfile(slurmd_pidfile(node))
    # ReturnToService=2 does not clear a drain left by an earlier run.
    ready = slurmd_ready(node)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not ready():
        if any(bad in node_state(node) for bad in ("drain", "down")):
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
        time.sleep(0.5)
    return pid


# ---------------------------------------------------------------------------------------------- sshd
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


# ---------------------------------------------------------------------------------------------- spark
def spark_home() -> Path:
    found = sorted((VENV / "lib").glob("python3*/site-packages/pyspark"))
    if not found:
        raise RuntimeError(f"pyspark is not installed in {VENV}; run `make venv` first")
    return found[0]


def spark_env() -> dict:
    return dict(
        os.environ, SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(P.spark / "logs"),
        SPARK_WORKER_DIR=str(P.spark / "work"), PYSPARK_PYTHON=str(VENV / "bin/python"),
        PATH=f"{VENV / 'bin'}:{os.environ['PATH']}",
    )


def spark_class(cls: str, args: list[str], logname: str) -> int:
    """Run a Spark daemon in the foreground of its own session (spark-class execs java: the PID is the JVM's)."""
    env = spark_env()
    for sub in ("logs", "work"):
        ensure_dir(P.spark / sub, owner=SERVICE_USER, mode=0o700)
    ensure_dir(P.spark, owner=SERVICE_USER, mode=0o700)
    give_to_service_user(P.spark)
    # The service user's: executors write features into the shared storage, as the drivers that commit them.
    return spawn([f"{env['SPARK_HOME']}/bin/spark-class", cls, *args], P.logs / logname, env=env,
                 service_user=True)


def start_spark_master() -> int:
    return spark_class("org.apache.spark.deploy.master.Master", [
        "--host", "127.0.0.1", "--port", str(STACK["spark_master_port"]),
        "--webui-port", str(STACK["spark_master_ui_port"]),
    ], "spark-master.log")


def start_spark_worker() -> int:
    # The worker retries its registration, so it need not wait for the master.
    return spark_class("org.apache.spark.deploy.worker.Worker", [
        "--host", "127.0.0.1", "--cores", str(STACK["spark_worker_cores"]), "--memory", STACK["spark_worker_memory"],
        "--webui-port", str(STACK["spark_worker_ui_port"]), f"spark://127.0.0.1:{STACK['spark_master_port']}",
    ], "spark-worker.log")


def spark_worker_ready() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{STACK['spark_master_ui_port']}/json/", timeout=5) as resp:
            return any(w.get("state") == "ALIVE" for w in json.load(resp).get("workers", []))
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------- triton
def pytriton_dir() -> Path:
    found = sorted((SERVING_VENV / "lib").glob("python3*/site-packages/pytriton"))
    if not found:
        raise RuntimeError(f"nvidia-pytriton is not installed in {SERVING_VENV}; run `make venv` first")
    return found[0]


def triton_backend_dir() -> Path:
    """The python backend assembled from the wheel's parts, with the stub for the serving interpreter."""
    bundle = pytriton_dir() / "tritonserver"
    minor = run([str(SERVING_VENV / "bin/python"), "-c",
                 "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"]).stdout.strip()
    backend = P.triton / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for src in (bundle / "backends/python/libtriton_python.so",
                bundle / "backends/python/triton_python_backend_utils.py",
                bundle / f"python_backend_stubs/{minor}/triton_python_backend_stub"):
        dst = backend / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return backend.parent


def triton_env() -> dict:
    libdir = run([str(SERVING_VENV / "bin/python"), "-c",
                  "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"]).stdout.strip()
    libs = pytriton_dir().parent / "nvidia_pytriton.libs"
    # The stub must load the serving interpreter's own libpython (not Debian's) and find its numpy via PATH.
    return dict(os.environ, LD_LIBRARY_PATH=f"{libs}:{libdir}", PATH=f"{SERVING_VENV / 'bin'}:{os.environ['PATH']}")


def triton_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['triton_http_port']}/v2/health/ready")


def triton_upstream_port() -> int:
    return int(STACK.get("triton_upstream_http_port", STACK["triton_http_port"] + 10))


def triton_upstream_grpc_port() -> int:
    return int(STACK.get("triton_upstream_grpc_port", STACK["triton_grpc_port"] + 10))


def start_triton() -> int:
    """The guard (jobs/tritonguard) on Triton's public HTTP and gRPC ports, supervising tritonserver on loopback
    ports of its own: a hostile infer request gets a 4xx (INVALID_ARGUMENT) from the guard, requests without a
    version follow the model's release, and a dead server is started again."""
    backends = triton_backend_dir()
    binary = pytriton_dir() / "tritonserver/bin/tritonserver"
    upstream = triton_upstream_port()
    server = [
        str(binary), f"--model-repository={P.storage / 'model-repository'}", "--model-control-mode=explicit",
        "--http-address=127.0.0.1", f"--http-port={upstream}",
        "--grpc-address=127.0.0.1", f"--grpc-port={triton_upstream_grpc_port()}",
        "--metrics-address=127.0.0.1", f"--metrics-port={STACK['triton_metrics_port']}",
        f"--backend-directory={backends}", "--exit-timeout-secs=10", "--log-verbose=0",
        # A deploy whose model fails to load must not mark the whole server unready (and pull the versions
        # that still serve out of a load balancer): readiness is judged per model by the deploy operator.
        "--strict-readiness=false",
        # A restart serves again what each model's config.pbtxt version policy names (explicit mode starts empty
        # otherwise); one model failing to load there must not keep the server, and every other model, down.
        "--load-model=*", "--exit-on-error=false",
        f"--backend-config=python,shm-region-prefix-name=hybridflow{STACK['triton_http_port']}",
    ]
    guard = [str(SERVING_VENV / "bin/python"), "-m", "tritonguard",
             f"--listen=127.0.0.1:{STACK['triton_http_port']}", f"--upstream=http://127.0.0.1:{upstream}",
             f"--grpc-listen=127.0.0.1:{STACK['triton_grpc_port']}",
             f"--grpc-upstream=127.0.0.1:{triton_upstream_grpc_port()}",
             f"--admin-listen=127.0.0.1:{STACK['triton_guard_admin_port']}",
             f"--state-file={P.triton / 'releases.json'}"]
    env = dict(triton_env(), PYTHONPATH=str(REPO / "jobs"))
    return spawn([*guard, "--", *server], P.logs / "triton.log", env=env)


# ---------------------------------------------------------------------------------------------- s3 endpoint
def start_s3() -> int:
    # moto's server is the S3-compatible endpoint that runs here (no MinIO binary on PyPI or Debian).
    return spawn([str(VENV / "bin/moto_server"), "-H", "127.0.0.1", "-p", str(STACK["s3_port"])], P.logs / "s3.log")


def s3_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['s3_port']}/")


# ---------------------------------------------------------------------------------------------- postgres
def postgres_port() -> int:
    return int(STACK.get("postgres_port", 5433))


def postgres_ready() -> bool:
    # This checkout's server, not another clone's on the same port (whose role would refuse our password).
    return pgstack.postmaster_pid(P.postgres) is not None and pgstack.ready(postgres_port())


def start_postgres() -> int:
    pgstack.ensure_cluster(P.postgres, postgres_port(), P.local_secrets, log, POSTGRES_MORE_LOGINS)
    return pgstack.start(P.postgres, postgres_port(), P.logs / "postgres.log")


def metadata_db_url() -> str:
    if METADATA_DB == "sqlite":
        return f"sqlite:///{P.airflow_home / 'airflow.db'}"
    return pgstack.sqlalchemy_url(pgstack.ensure_password(P.local_secrets), postgres_port())


# ---------------------------------------------------------------------------------------------- mlflow
def mlflow_port() -> int:
    return int(STACK.get("mlflow_port", 5000))


def mlflow_url() -> str:
    return f"http://127.0.0.1:{mlflow_port()}"


def mlflow_artifacts_destination() -> str:
    return f"s3://{STACK.get('mlflow_artifacts_bucket', 'hybridflow-mlflow')}"


def mlflow_store_uris() -> tuple[str, str]:
    """(tracking and registry store, auth store): the database and role `mlflow` in this checkout's PostgreSQL,
    the password in a libpq password file (the auth tables keep their own alembic version table beside the
    tracking tables); SQLite files in the server's folder when the stack runs without PostgreSQL."""
    if METADATA_DB == "sqlite":
        return f"sqlite:///{P.mlflow / 'mlflow.db'}", f"sqlite:///{P.mlflow / 'auth.db'}"
    uri = f"postgresql+psycopg2://{MLFLOW_LOGIN.role}@127.0.0.1:{postgres_port()}/{MLFLOW_LOGIN.database}"
    return uri, uri


def mlflow_admin() -> tuple[str, str]:
    return mlflowstack.ADMIN_USERNAME, secret("mlflow-admin-password", P.local_secrets)


def mlflow_client_password() -> str:
    """Airflow's MLflow password (the `airflow` MLflow user, no admin)."""
    return secret("mlflow-airflow-password", P.local_secrets)


def mlflow_files() -> dict[Path, str]:
    """The server's own files (0600, its user's) and their text, rendered from the generated secrets in
    .state/secrets: the auth config, the S3 credentials and (with PostgreSQL) the libpq password file."""
    files = {
        P.mlflow / "auth.ini": mlflowstack.auth_ini(mlflow_store_uris()[1], mlflow_admin()[1]),
        P.mlflow / "aws-credentials": mlflowstack.aws_credentials(secret("s3-access-key", P.local_secrets, 12),
                                                                  secret("s3-secret-key", P.local_secrets)),
    }
    if METADATA_DB == "postgres":
        db_password = pgstack.ensure_password(P.local_secrets, name=MLFLOW_LOGIN.password_file)
        files[P.mlflow / "pgpass"] = pgstack.pgpass_line(db_password, postgres_port(), MLFLOW_LOGIN.role,
                                                         MLFLOW_LOGIN.database)
    return files


def mlflow_server_env() -> dict[str, str]:
    return mlflowstack.server_env(
        home=P.mlflow, auth_config=P.mlflow / "auth.ini", pgpass=P.mlflow / "pgpass",
        aws_credentials_file=P.mlflow / "aws-credentials", s3_endpoint=f"http://127.0.0.1:{STACK['s3_port']}",
        flask_secret_key=secret("mlflow-flask-secret-key", P.local_secrets, 32),
        path=f"{MLFLOW_VENV / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
    )


def mlflow_command() -> list[str]:
    return mlflowstack.server_command(MLFLOW_VENV / "bin/mlflow", mlflow_port(), mlflow_store_uris()[0],
                                      mlflow_artifacts_destination(), int(STACK.get("mlflow_workers", 1)))


def mlflow_config_digest() -> str:
    """What a server is started with (command, environment, files): `up` restarts a running one when it changed."""
    config = [mlflow_command(), mlflow_server_env(), {str(path): text for path, text in mlflow_files().items()}]
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def write_mlflow_files() -> dict[str, str]:
    """The server's folder (its user's, 0700, reached through .state by a traverse-only ACL entry) and files;
    returns the server's environment."""
    ensure_dir(P.mlflow, owner=MLFLOW_USER, mode=0o700)
    run(["setfacl", "-m", f"u:{MLFLOW_USER}:x", str(STATE)])
    for path, text in mlflow_files().items():
        write_if_changed(path, text, 0o600, MLFLOW_USER)
    return mlflow_server_env()


def mlflow_venv_run(*args: str, env: dict) -> str:
    """scripts/mlflowstack.py in MLflow's venv, as its user, with the server's environment; its output."""
    return run([str(MLFLOW_VENV / "bin/python"), str(REPO / "scripts/mlflowstack.py"), *args], cwd=P.mlflow,
               **as_user(MLFLOW_USER, env, home=P.mlflow)).stdout.strip()


def ensure_mlflow_bucket(env: dict) -> None:
    """The artifact bucket, after the S3 endpoint or MLflow (re)started: moto keeps buckets in memory."""
    wait_for("s3 (MLflow's artifact store)", s3_ready, 60, P.logs / "s3.log")
    if mlflow_venv_run("ensure-bucket", mlflow_artifacts_destination(), env=env) == "created":
        log(f"mlflow: created the artifact bucket {mlflow_artifacts_destination()}")


def start_mlflow() -> int:
    if not (MLFLOW_VENV / "bin/mlflow").exists():
        raise RuntimeError(f"no MLflow venv at {MLFLOW_VENV}: run `make venv` (or `make up`) first")
    ensure_mlflow_user()
    ensure_checkout_reachable(MLFLOW_USER, MLFLOW_VENV, REPO / "scripts")
    if METADATA_DB == "postgres":
        # Its role and database, also in a cluster that an older version created (the server is up: cmd_up).
        pgstack.ensure_cluster(P.postgres, postgres_port(), P.local_secrets, log, POSTGRES_MORE_LOGINS)
    env = write_mlflow_files()
    # Its bucket is made once the S3 endpoint is up (cmd_up): the server needs it only for artifact requests.
    return spawn(mlflow_command(), P.logs / "mlflow.log", cwd=P.mlflow,
                 identity=as_user(MLFLOW_USER, env, home=P.mlflow))


def mlflow_ready() -> bool:
    return http_ok(f"{mlflow_url()}/health")


def ensure_mlflow_accounts() -> None:
    """The admin logs in with the password in .state/secrets, and Airflow's ordinary user with its own; the auth
    store is corrected when either does not (the first start, or the store kept in PostgreSQL by `make clean`)."""
    client = (MLFLOW_CLIENT_USER, mlflow_client_password())
    if all(mlflowstack.authenticates(mlflow_url(), login) for login in (mlflow_admin(), client)):
        return
    env = dict(write_mlflow_files(), MLFLOW_USER_NAME=client[0], MLFLOW_USER_PASSWORD=client[1])
    for change in mlflow_venv_run("ensure-accounts", env=env).splitlines():
        log(f"mlflow: {change}")


# ---------------------------------------------------------------------------------------------- airflow
def fill_placeholders(node, values: dict):
    """Replace ${name} in a profile's values; a value that is one whole placeholder keeps its type (ports)."""
    if isinstance(node, dict):
        return {key: fill_placeholders(value, values) for key, value in node.items()}
    if isinstance(node, list):
        return [fill_placeholders(value, values) for value in node]
    if not isinstance(node, str):
        return node
    whole = node.strip()
    if whole.startswith("${") and whole.endswith("}") and whole.count("${") == 1:
        name = whole[2:-1]
        if name not in values:
            raise RuntimeError(
                f"profile {PROFILE}: unknown placeholder ${{{name}}}; known: {', '.join(sorted(values))}")
        return values[name]
    try:
        return Template(node).substitute(values)
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"profile {PROFILE}: bad placeholder in {node!r}: {exc}") from exc


def render_connections() -> dict[str, dict]:
    values = dict(
        STACK,
        ssh_key_file=str(P.ssh_client / "id_ed25519"),
        ssh_host_key=ensure_host_key(),
        known_hosts_file=str(P.ssh_client / "known_hosts"),
        s3_access_key=secret("s3-access-key", P.local_secrets, 12),
        s3_secret_key=secret("s3-secret-key", P.local_secrets),
        mlflow_login=MLFLOW_CLIENT_USER,
        mlflow_password=mlflow_client_password(),
    )
    return {conn_id: fill_placeholders(spec, values) for conn_id, spec in PROF["connections"].items()}


def fernet_key(nbytes: int) -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(nbytes)).decode()


def write_known_hosts(host_key: str) -> None:
    port = STACK["ssh_port"]
    text = "".join(f"[{h}]:{port} {host_key}\n" for h in ("127.0.0.1", "localhost"))
    write_if_changed(P.ssh_client / "known_hosts", text, owner=SERVICE_USER)


def airflow_env() -> dict[str, str]:
    home = P.airflow_home
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": str(STACK["airflow_parallelism"]),
        "AIRFLOW__CORE__FERNET_KEY": secret("fernet-key", P.local_secrets, 32, make=fernet_key),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{STACK['airflow_api_port']}/execution/",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_db_url(),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(STACK["airflow_api_port"]),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{STACK['airflow_api_port']}",
        "AIRFLOW__API__SECRET_KEY": secret("api-secret-key", P.local_secrets),
        "AIRFLOW__API_AUTH__JWT_SECRET": secret("jwt-secret", P.local_secrets, 32),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # The one deferral policy of every Slurm, Triton and checkpoint wait: in the triggerer, not a worker slot.
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        "HYBRIDFLOW_STORAGE_ROOT": str(P.storage),
        "HYBRIDFLOW_CLUSTER_DIR": str(P.cluster),
        "HYBRIDFLOW_JOB_USER": JOB_USER,
        # Written into every Slurm job's key: this checkout's Airflow reconciles only the jobs it submitted.
        "HYBRIDFLOW_DEPLOYMENT": f"local-{hashlib.sha256(str(STATE).encode()).hexdigest()[:12]}",
        "HYBRIDFLOW_SERVICE_USER": SERVICE_USER,
        "HYBRIDFLOW_CLUSTER_PYTHON": str(P.cluster_venv / "bin/python"),
        "HYBRIDFLOW_CLUSTER_JOBS_DIR": str(P.cluster_code / "jobs"),
        "HYBRIDFLOW_STATE_DIR": str(STATE),
        "PYSPARK_PYTHON": str(VENV / "bin/python"),
        # Spark drivers that tasks launch (spark-submit, client mode) bind their ports and UI to loopback.
        "SPARK_LOCAL_IP": "127.0.0.1",
        # No upstream producer here: the nightly pipeline generates the day's raw events itself.
        "HYBRIDFLOW_SIMULATE_RAW": "true",
        # Loopback gloo on 2 shared cores spends ~20-30% of a small model's step in all-reduce (pipeline.yaml), and
        # 55-58% while the test suite loads the cores (measured 2026-12-04, 2 nodes x 1 rank): latency, not a network
        # fault, so the local limit leaves room for it.
        "HYBRIDFLOW_MAX_ALLREDUCE_SHARE": "0.75",
        # node-local scratch of each Slurm node (the same disk here), probed by the node self-check
        "HYBRIDFLOW_NODE_SCRATCH_DIR": f"{P.node_scratch}/%n",
        # MLflow's client reads these: the tracking server, and Airflow's own MLflow account (not the admin).
        "MLFLOW_TRACKING_URI": mlflow_url(),
        "MLFLOW_TRACKING_USERNAME": MLFLOW_CLIENT_USER,
        "MLFLOW_TRACKING_PASSWORD": mlflow_client_password(),
        # Fixed, not the caller's: `up` from another shell or interpreter (pyenv's shims rewrite PATH) must not look
        # like a changed environment and restart every running component.
        "PATH": f"{VENV / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    for conn_id, spec in render_connections().items():
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(spec, sort_keys=True)
    return env


def write_airflow_files() -> dict[str, str]:
    ensure_dir(P.airflow_home, owner=SERVICE_USER, mode=0o700)
    give_to_service_user(P.airflow_home)
    write_known_hosts(ensure_host_key())
    passwords = P.airflow_home / "passwords.json"
    if not passwords.exists():
        write_if_changed(passwords, json.dumps({"admin": secrets.token_urlsafe(12)}), mode=0o600, owner=SERVICE_USER)
    env = airflow_env()
    write_if_changed(STATE / "airflow-env.json", json.dumps(env, indent=2, sort_keys=True), mode=0o600)
    return env


def airflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    return run([str(VENV / "bin/airflow"), *args], cwd=REPO, **as_service_user(dict(os.environ, **env)))


def migrate_airflow_db() -> None:
    env = write_airflow_files()
    stamp = P.airflow_home / ".migrated"
    version = ",".join([METADATA_DB, *sorted(
        p.name for p in (VENV / "lib").glob("python3*/site-packages/apache_airflow-*.dist-info"))])
    if not stamp.exists() or stamp.read_text() != version:
        log("migrating the Airflow metadata DB")
        airflow("db", "migrate", env=env)
        stamp.write_text(version)
        chown(stamp, SERVICE_USER)
    # Pools keep a backfill from flooding the GPU partition or Spark; the DAGs name them.
    pools = REPO / "include/config/pools.json"
    pools_stamp = P.airflow_home / ".pools"
    digest = hashlib.sha256(pools.read_bytes() + METADATA_DB.encode()).hexdigest()
    if not pools_stamp.exists() or pools_stamp.read_text() != digest:
        log("importing Airflow pools from include/config/pools.json")
        airflow("pools", "import", str(pools), env=env)
        pools_stamp.write_text(digest)
        chown(pools_stamp, SERVICE_USER)


def start_airflow_component(component: str) -> int:
    env = dict(os.environ, **write_airflow_files())
    # The log server binds every interface and cannot be told otherwise; logs are read from the shared
    # local log folder instead, so it is not started.
    extra = ["--skip-serve-logs"] if component in ("scheduler", "triggerer") else []
    return spawn([str(VENV / "bin/airflow"), component, *extra], P.logs / f"airflow-{component}.log", env=env,
                 cwd=REPO, service_user=True)


def airflow_api_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['airflow_api_port']}/api/v2/monitor/health")


def airflow_health(component: str) -> dict:
    """The api-server's health entry of one component (status, last heartbeat); empty when it does not answer."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{STACK['airflow_api_port']}/api/v2/monitor/health", timeout=5
        ) as resp:
            return json.load(resp).get(component) or {}
    except (OSError, ValueError):
        return {}


def airflow_component_ready(component: str) -> Callable[[], bool]:
    def ready() -> bool:
        return airflow_health(component).get("status") == "healthy"

    return ready


# ---------------------------------------------------------------------------------------------- the stack
def services() -> list[Service]:
    sp, tp = STACK["ssh_port"], STACK["triton_http_port"]
    api = STACK["airflow_api_port"]
    return [
        Service("munge", munge_ready, start_munge, comm="munged", endpoint="/run/munge/munge.socket.2"),
        Service("mariadb", mariadb_ready, start_mariadb, comm="mariadbd",
                endpoint=f"127.0.0.1:{STACK['mariadb_port']}", logfile=P.logs / "mariadb.log"),
        Service("slurmdbd", slurmdbd_ready, start_slurmdbd, comm="slurmdbd", endpoint="127.0.0.1:6819",
                logfile=P.slurm / "log/slurmdbd.log"),
        Service("slurmctld", slurmctld_ready, start_slurmctld, comm="slurmctld", endpoint="127.0.0.1:6817",
                logfile=P.slurm / "log/slurmctld.log"),
        *[Service(f"slurmd-{node}", slurmd_ready(node), lambda node=node: start_slurmd(node), comm="slurmd",
                  endpoint=f"{node} 127.0.0.1:{slurmd_port(node)}", logfile=P.slurm / f"log/slurmd-{node}.log")
          for node in SLURM_NODES],
        Service("sshd", sshd_ready, start_sshd, comm="sshd", endpoint=f"ssh://{JOB_USER}@127.0.0.1:{sp}"),
        Service("spark-master", lambda: port_open(STACK["spark_master_port"]), start_spark_master, comm="java",
                endpoint=f"spark://127.0.0.1:{STACK['spark_master_port']}", logfile=P.logs / "spark-master.log"),
        Service("spark-worker", spark_worker_ready, start_spark_worker, comm="java",
                endpoint=f"http://127.0.0.1:{STACK['spark_worker_ui_port']}", logfile=P.logs / "spark-worker.log"),
        Service("triton", triton_ready, start_triton, comm="python", endpoint=f"http://127.0.0.1:{tp}",
                logfile=P.logs / "triton.log"),
        Service("s3", s3_ready, start_s3, comm="moto_server", endpoint=f"http://127.0.0.1:{STACK['s3_port']}",
                logfile=P.logs / "s3.log"),
        *([Service("postgres", postgres_ready, start_postgres, comm="postgres",
                   endpoint=f"127.0.0.1:{postgres_port()}", logfile=P.logs / "postgres.log")]
          if METADATA_DB == "postgres" else []),
        Service("mlflow", mlflow_ready, start_mlflow, comm="mlflow", endpoint=mlflow_url(),
                logfile=P.logs / "mlflow.log", timeout=90),
        Service("airflow-api-server", airflow_api_ready, lambda: start_airflow_component("api-server"),
                comm="airflow", endpoint=f"http://127.0.0.1:{api}", logfile=P.logs / "airflow-api-server.log",
                timeout=90),
        Service("airflow-scheduler", airflow_component_ready("scheduler"),
                lambda: start_airflow_component("scheduler"), comm="airflow",
                logfile=P.logs / "airflow-scheduler.log", timeout=90),
        Service("airflow-dag-processor", airflow_component_ready("dag_processor"),
                lambda: start_airflow_component("dag-processor"), comm="airflow",
                logfile=P.logs / "airflow-dag-processor.log", timeout=90),
        Service("airflow-triggerer", airflow_component_ready("triggerer"),
                lambda: start_airflow_component("triggerer"), comm="airflow",
                logfile=P.logs / "airflow-triggerer.log", timeout=90),
    ]


# The one-node versions' slurmd service: only its pid file is still read (`up` and `down` stop that slurmd).
LEGACY_SLURMD = Service("slurmd", lambda: False, lambda: None, comm="slurmd")
# Triton as started before the guard: tritonserver itself on the public port, its pid in triton.pid.
UNGUARDED_TRITON = Service("triton", lambda: False, lambda: None, comm="tritonserver")
SLURM_SERVICES = ("slurmdbd", "slurmctld", "slurmd-")


def by_name(names: list[str]) -> list[Service]:
    all_services = services()
    known = {s.name for s in all_services}
    # `slurmd` (the one service of the one-node versions) means every node's slurmd.
    names = [n for name in names for n in ([s.name for s in all_services if s.name.startswith("slurmd-")]
                                           if name == "slurmd" else [name])]
    unknown = sorted(set(names) - known)
    if unknown:
        sys.exit(f"unknown service(s) {', '.join(unknown)}; choose from: {', '.join(s.name for s in all_services)}")
    return [s for s in all_services if not names or s.name in names]


def cmd_up(names: list[str]) -> int:
    if os.geteuid() != 0:
        sys.exit("localstack must run as root: it installs packages and starts Slurm daemons as their users")
    t0 = time.monotonic()
    ensure_packages()
    ensure_job_user()
    ensure_service_user()
    ensure_state_dir()
    # Keys, passwords, tokens and the logs that could echo them: for root only.
    for d in (P.run_dir, P.logs, P.local_secrets):
        ensure_dir(d, mode=0o700)
    ensure_checkout_reachable()
    ensure_storage()
    ensure_client_key()
    ensure_cluster_env()
    deploy_jobs()
    write_airflow_files()
    chosen = by_name(names)
    db_started_at = None
    if any(s.name.startswith("airflow") or s.name == "mlflow" for s in chosen):
        # The database first: Airflow's migration below, every Airflow component and MLflow need it.
        for db in by_name(["postgres"]) if METADATA_DB == "postgres" else []:  # by_name([]) would be all
            if not db.ready():
                log("postgres: starting")
                db_started_at = time.time()
                db.pidfile.write_text(f"{db.start()}\n")
                wait_for(db.name, db.ready, db.timeout, db.logfile)
                log("postgres: ready")
            chosen = [s for s in chosen if s.name != db.name]
    if any(s.name.startswith("airflow") for s in chosen):
        migrate_airflow_db()
    if any(s.name.startswith(SLURM_SERVICES) for s in chosen) and reconcile_slurm_config():
        # Restarted on a changed configuration: the controller and every node come back, whatever was asked.
        wanted = {s.name for s in chosen}
        chosen = [s for s in services() if s.name in wanted or s.name == "slurmctld" or s.name.startswith("slurmd-")]
    unguarded = UNGUARDED_TRITON.owned_pid() if any(s.name == "triton" for s in chosen) else None
    if unguarded:
        log("triton: replacing the server started without the guard")
        stop_pid("triton", unguarded)
    pending: list[Service] = []
    started: set[str] = set()
    env_digest = hashlib.sha256(json.dumps(airflow_env(), sort_keys=True).encode()).hexdigest()
    # What a running Airflow component or MLflow server was started with: it keeps that until restarted.
    digests = {svc.name: env_digest if svc.name.startswith("airflow") else mlflow_config_digest()
               for svc in chosen if svc.name.startswith("airflow") or svc.name == "mlflow"}
    # Airflow's components are the slowest to start and need nothing from the cluster: start them first.
    for svc in sorted(chosen, key=lambda svc: not svc.name.startswith("airflow")):
        stamp = P.run_dir / f"{svc.name}.env"
        if svc.name.startswith("slurmd-") and "slurmctld" in started and svc.owned_pid():
            # A controller that just started has not heard from the running slurmds yet (their nodes show unknown
            # or not responding): let them register before judging them; restarting one would abort its job steps.
            node = svc.name.removeprefix("slurmd-")
            try:
                wait_for(f"{node} registering with slurmctld", lambda node=node: node_registered(node), 30)
            except RuntimeError as exc:
                log(f"{svc.name}: {exc}")
        restart = bool(svc.name in digests and svc.owned_pid() and stamp.exists()
                       and stamp.read_text() != digests[svc.name])
        if restart:
            # A running component keeps the environment it was started with (connections included).
            log(f"{svc.name}: environment changed since it started; restarting it")
            stop_pid(svc.name, svc.owned_pid())
        elif svc.name.startswith(SERVICE_USER_SERVICES) and svc.owned_pid() and (
                proc_uid(svc.owned_pid()) != pwd.getpwnam(SERVICE_USER).pw_uid):
            restart = True
            log(f"{svc.name}: running as uid {proc_uid(svc.owned_pid())}, not {SERVICE_USER}; restarting it")
            stop_pid(svc.name, svc.owned_pid())
        if not restart and svc.name.startswith("airflow") and svc.pidfile.exists() and not svc.owned_pid() \
                and svc.ready():
            # Its health is the api-server's view of its last heartbeat, which stays "healthy" for a while after
            # the process died (a SIGKILL): this checkout started it and it is gone, so it starts again.
            log(f"{svc.name}: its process is gone (the health endpoint still shows its last heartbeat); starting it")
        elif not restart and svc.ready():
            note = "" if svc.owned_pid() else " (not started by this checkout; left alone by `down`)"
            log(f"{svc.name}: already up{note}")
            continue
        if svc.name == "triton" and port_open(STACK["triton_http_port"]):
            # The guard answers but the server behind it is not ready: it is (re)starting under the guard.
            log("triton: the guard is up and the server behind it is starting; waiting for it")
            pending.append(svc)
            continue
        log(f"{svc.name}: starting")
        started.add(svc.name)
        pid = svc.start()
        if pid:
            svc.pidfile.write_text(f"{pid}\n")
        if svc.name in digests:
            stamp.write_text(digests[svc.name])
        # Daemons that others depend on must be ready before the next starts; the leaves are waited for below.
        if svc.name in ("munge", "mariadb", "slurmdbd", "slurmctld"):
            wait_for(svc.name, svc.ready, svc.timeout, svc.logfile)
        else:
            pending.append(svc)
    for svc in pending:
        wait_for(svc.name, svc.ready, svc.timeout, svc.logfile)
        log(f"{svc.name}: ready")
    reap_orphaned_executor_workers()
    if db_started_at is not None:
        restart_airflow_that_lost_its_database([s for s in chosen if s.name in AIRFLOW_HEARTBEATS], db_started_at)
    mlflow = by_name(["mlflow"])[0]
    if started & {"s3", "mlflow"} and mlflow.owned_pid():
        ensure_mlflow_bucket(write_mlflow_files())
    if any(s.name == "mlflow" for s in chosen) and mlflow.owned_pid():
        ensure_mlflow_accounts()
        import_file_registry()
    log(f"up in {time.monotonic() - t0:.1f} s")
    return cmd_status(names, as_json=False)


# Airflow's components that heartbeat into the metadata DB, by their key in the api-server's health endpoint.
AIRFLOW_HEARTBEATS = {"airflow-scheduler": "scheduler", "airflow-triggerer": "triggerer",
                      "airflow-dag-processor": "dag_processor"}


def airflow_heartbeat(component: str) -> float:
    """When the component last heartbeat (epoch seconds), per the api-server; 0 when unknown."""
    beat = next((value for key, value in airflow_health(component).items() if key.startswith("latest_") and value),
                None)
    try:
        return datetime.fromisoformat(beat).timestamp() if beat else 0.0
    except ValueError:
        return 0.0


def restart_airflow_that_lost_its_database(components: list[Service], db_started_at: float,
                                            timeout_s: float = 600) -> None:
    """PostgreSQL was started again under running Airflow components: one that hit the outage shuts itself down
    (the scheduler first lets its running tasks finish), one that did not heartbeats on. Wait for each to do one
    or the other, and start the ones that exited: one `up` brings the whole control plane back."""
    for svc in components:
        deadline, told = time.monotonic() + timeout_s, False
        while svc.owned_pid() and airflow_heartbeat(AIRFLOW_HEARTBEATS[svc.name]) <= db_started_at:
            if time.monotonic() > deadline:
                log(f"{svc.name}: neither heartbeat nor exited {timeout_s:.0f} s after the database came back; "
                    f"restart it: localstack down {svc.name} && localstack up {svc.name}")
                break
            if not told:
                log(f"{svc.name}: waiting until it heartbeats on the restarted database or exits (it lets its "
                    "running tasks finish first)")
                told = True
            time.sleep(1)
        if not svc.owned_pid():
            log(f"{svc.name}: exited after losing its database; starting it")
            svc.pidfile.write_text(f"{svc.start()}\n")
            wait_for(svc.name, svc.ready, svc.timeout, svc.logfile)
            log(f"{svc.name}: ready")


def import_file_registry() -> None:
    """The suite's earlier file registry (models/<name>/registry.json) into MLflow, once: the module renames the
    file when done, so this is a check of one path on every later `up`."""
    found = sorted((P.storage / "models").glob("*/registry.json"))
    if not found:
        return
    log(f"importing {', '.join(map(str, found))} into the MLflow model registry (nightly.model_name's)")
    done = run([str(VENV / "bin/python"), "-m", "hybridflow.pipeline.registry", "import-json"], cwd=REPO, check=False,
               **as_service_user(dict(os.environ, **airflow_env())))
    if done.returncode != 0:
        sys.exit(f"importing the file registry failed (exit {done.returncode}): {done.stderr[-2000:]}; the stack is "
                 "up: fix what it says and run `make up` again (the import resumes without duplicates)")
    log(f"registry import: {done.stdout.strip()}")


def orphaned_executor_workers() -> list[int]:
    """Idle LocalExecutor workers of the service user whose scheduler is gone (reparented to PID 1)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        try:
            idle = cmdline.read_bytes().startswith(b"airflow worker -- LocalExecutor: <idle>")
            orphaned = idle and (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1] == "1"
        except OSError:
            continue
        if orphaned and proc_uid(pid) == pwd.getpwnam(SERVICE_USER).pw_uid:
            found.append(pid)
    return found


def reap_orphaned_executor_workers() -> int:
    """Kill idle LocalExecutor workers whose scheduler is gone (a SIGKILLed scheduler leaves its four behind,
    ~170 MB each, waiting forever on a queue nobody feeds). A worker still running a task is left to finish it."""
    reaped = 0
    for pid in orphaned_executor_workers():
        try:
            os.kill(pid, signal.SIGKILL)
            reaped += 1
        except ProcessLookupError:
            pass
    if reaped:
        log(f"killed {reaped} idle LocalExecutor worker(s) left behind by a scheduler that died")
    return reaped


def child_groups(pid: int) -> set[int]:
    """Process groups led by a descendant of pid (the Triton guard runs tritonserver in a group of its own)."""
    parent_of, group_of = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        parent_of[child], group_of[child] = int(fields[1]), int(fields[2])
    descendants, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier} - descendants
        descendants |= frontier
    return {child for child in descendants if group_of[child] == child}


def stop_pid(name: str, pid: int, group: bool = True) -> None:
    # Processes we spawned lead their own session: signal the group so children go too, and afterwards any group a
    # child leads that its parent did not end (a SIGKILLed guard leaves tritonserver's).
    led = child_groups(pid) if group else set()
    try:
        target = -pid if group and os.getpgid(pid) == pid else pid
        os.kill(target, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    if pid_alive(pid):
        log(f"{name}: did not stop after SIGTERM; sending SIGKILL")
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for leader in led:
        try:
            os.killpg(leader, signal.SIGKILL)
            log(f"{name}: killed process group {leader} its child left behind")
        except ProcessLookupError:
            pass


def cmd_down(names: list[str]) -> int:
    chosen = by_name(names)
    if any(s.name.startswith("slurmd-") for s in chosen):
        chosen.append(LEGACY_SLURMD)  # a slurmd started by a one-node version (stopped first: reversed below)
    if any(s.name == "triton" for s in chosen) and UNGUARDED_TRITON.owned_pid():
        chosen = [s for s in chosen if s.name != "triton"] + [UNGUARDED_TRITON]  # started without the guard
    for svc in reversed(chosen):
        pid = svc.owned_pid()
        if pid is None:
            svc.pidfile.unlink(missing_ok=True)
            continue
        log(f"{svc.name}: stopping pid {pid}")
        if svc.name == "postgres":
            # Its backends leave the postmaster's process group; SIGINT (fast shutdown) ends them all.
            pgstack.stop(pid, data_dir=P.postgres)
        else:
            stop_pid(svc.name, pid)
        svc.pidfile.unlink(missing_ok=True)
    if any(svc.name == "airflow-scheduler" for svc in chosen):
        reap_orphaned_executor_workers()
    return 0


def cmd_status(names: list[str], as_json: bool) -> int:
    rows = []
    for svc in by_name(names):
        up = svc.ready()
        pid = svc.owned_pid()
        rows.append({"service": svc.name, "up": up, "pid": pid, "endpoint": svc.endpoint,
                     "log": str(svc.logfile or "")})
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            state = "up" if r["up"] else "DOWN"
            owner = f"pid {r['pid']}" if r["pid"] else ("external" if r["up"] else "-")
            print(f"{r['service']:<22} {state:<5} {owner:<10} {r['endpoint']}")
        if any(r["service"] == "airflow-api-server" and r["up"] for r in rows):
            print(f"Airflow UI: http://127.0.0.1:{STACK['airflow_api_port']}  login: admin, password in "
                  f"{P.airflow_home / 'passwords.json'}")
        if any(r["service"] == "mlflow" and r["up"] for r in rows):
            print(f"MLflow UI: {mlflow_url()}  login: {mlflowstack.ADMIN_USERNAME}, password in "
                  f"{P.local_secrets / 'mlflow-admin-password'} (Airflow's user: {MLFLOW_CLIENT_USER})")
    return 0 if all(r["up"] for r in rows) else 1


def cmd_env() -> int:
    env = json.loads((STATE / "airflow-env.json").read_text()) if (STATE / "airflow-env.json").exists() else None
    if env is None:
        sys.exit("no .state/airflow-env.json yet: run `make up` first")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status"):
        p = sub.add_parser(name)
        p.add_argument("services", nargs="*", help="limit to these services (default: all)")
        if name == "status":
            p.add_argument("--json", action="store_true")
    sub.add_parser("env")
    args = parser.parse_args(argv)
    try:
        if args.command in ("up", "down"):
            # One at a time: two concurrent `up`s (parallel test sessions) would each start a copy of a
            # service and leave one of them orphaned, its pid file overwritten.
            STATE.mkdir(mode=0o700, exist_ok=True)
            with open(STATE / ".localstack.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return cmd_up(args.services) if args.command == "up" else cmd_down(args.services)
        if args.command == "status":
            return cmd_status(args.services, args.json)
        return cmd_env()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"[localstack] error: {exc} {detail.strip()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
