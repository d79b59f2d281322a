"""What every part of the local stack shares: the profile, the paths, logging, file and process helpers, and
`Service`, one process of the stack."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# ------------------------------------------------------------------------------------------------------ profile & paths
REPO = Path(__file__).resolve().parents[2]  # scripts/stack/common.py
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state")).resolve()
PROFILE = Path(os.environ.get("HYBRIDFLOW_PROFILE", REPO / "include/profiles/local.json")).resolve()
VENV = REPO / ".venv"
SERVING_VENV = REPO / ".venv-serving"
MLFLOW_VENV = REPO / ".venv-mlflow"

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[localstack {time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=True, **kw)


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

# Airflow's metadata database: PostgreSQL (the default), or SQLite in the Airflow home when asked for
# (HYBRIDFLOW_METADATA_DB=sqlite, or the profile's `metadata_db`): fine for trying it out, not for load.
METADATA_DB = os.environ.get("HYBRIDFLOW_METADATA_DB", STACK.get("metadata_db", "postgres"))
if METADATA_DB not in ("postgres", "sqlite"):
    sys.exit(f"HYBRIDFLOW_METADATA_DB / profile metadata_db must be 'postgres' or 'sqlite', not {METADATA_DB!r}")


# ---------------------------------------------------------------------------------------------------------------- files
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


# ------------------------------------------------------------------------------------------------------------ processes
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
