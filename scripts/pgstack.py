"""Debian's PostgreSQL as the local stack's Airflow metadata database, without systemd (standard library only).

    url = ensure_cluster(data_dir, port, secrets_dir, log)   # initdb once, config, role + database; the URL
    ensure_cluster(..., more_logins=[Login("mlflow", "mlflow", "postgres-mlflow")])  # other roles, own databases
    pid = start(data_dir, port, logfile)                     # the postmaster, as `postgres`, in its own session
    ready(port)                                              # accepting connections on 127.0.0.1:port?
    stop(pid)                                                # fast shutdown: SIGINT to the postmaster only

The cluster is our own (its own data directory, port and socket directory), never Debian's default
`/var/lib/postgresql/<ver>/main`, which the package creates at install time and which is left alone (and never
started: packages are installed with a policy-rc.d that exits 101). It listens on 127.0.0.1 only; TCP logins need
a SCRAM-SHA-256 password and only the `airflow` role may log in to the `airflow` database that way (and each
further login named by the caller to its own database: MLflow's); the superuser
`postgres` logs in over the unix socket by peer authentication only (socket directory inside the data directory,
0700). Each generated password lives in a 0600 file in `secrets_dir`; only its SCRAM verifier ever reaches the
server, over psql's stdin, so it is in no process list, no shell string and no server log.

Stopping: SIGINT to the postmaster (fast shutdown: ends the sessions, writes a checkpoint, exits; what
`pg_ctl stop -m fast` does). Not SIGTERM (smart shutdown waits for every client to disconnect: Airflow's pooled
connections can hold it open indefinitely), not the process group (every backend would get the signal), and never
SIGKILL (the backends survive it holding the shared memory, and the next start fails until they are gone). If the
fast shutdown does not finish, `stop` falls back to SIGQUIT (immediate shutdown; crash recovery at the next start).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pwd
import re
import secrets
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

PG_VERSION = "15"  # Debian 12 (bookworm)
APT_PACKAGES = [f"postgresql-{PG_VERSION}", f"postgresql-client-{PG_VERSION}"]
BIN_DIR = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")  # Debian keeps initdb, postgres, pg_ctl off PATH
# Absolute paths: `shutil.which` checks them as they are, so these fit the stack's REQUIRED_BINARIES check
# (scripts/stack/system.py).
REQUIRED_BINARIES = [str(BIN_DIR / name) for name in ("initdb", "postgres", "pg_ctl", "psql", "pg_isready")]

PG_USER = "postgres"  # the system user that owns the cluster and runs the server
ROLE = "airflow"
DATABASE = "airflow"
PASSWORD_FILE = "postgres-airflow"  # in secrets_dir
PROVISIONED_STAMP = "hybridflow-provisioned"  # in the data directory: digest of role, database and password
SOCKET_SUBDIR = "run"  # in the data directory
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, NUL included

Log = Callable[[str], None]


class Login(NamedTuple):
    """A role that logs in over TCP with a SCRAM password to the one database it owns."""

    role: str
    database: str
    password_file: str  # in secrets_dir


AIRFLOW_LOGIN = Login(ROLE, DATABASE, PASSWORD_FILE)


# ---------------------------------------------------------------------------------------------- pure builders
def socket_dir(data_dir: Path) -> Path:
    return Path(data_dir) / SOCKET_SUBDIR


def postgresql_conf(port: int, sock_dir: Path) -> str:
    """The whole postgresql.conf (replaces initdb's): loopback only, tuned for 2 cores / 24 GiB shared with
    Spark, Triton, Slurm and DeepSpeed, and about 50 concurrent Airflow connections (200 allowed)."""
    sock = str(sock_dir)
    if "'" in sock or "\\" in sock:
        raise ValueError(f"unsupported character in the socket directory {sock!r}")
    if len(f"{sock}/.s.PGSQL.{port}") > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {sock}/.s.PGSQL.{port} is longer than {MAX_SOCKET_PATH} bytes")
    return f"""\
# Written by scripts/pgstack.py (hybridflow's local stack); rewritten at every `make up`: edit the module instead.

# connections
listen_addresses = '127.0.0.1'
port = {int(port)}
unix_socket_directories = '{sock}'
unix_socket_permissions = 0700
max_connections = 200                   # ~50 used by Airflow's components and API server; room for bursts
superuser_reserved_connections = 3
password_encryption = scram-sha-256
ssl = off                               # loopback only

# memory: modest, the machine is shared with Spark, Triton, Slurm and DeepSpeed
shared_buffers = 256MB
effective_cache_size = 2GB
work_mem = 8MB                          # per sort/hash; 200 sessions x 8 MB stays far below the RAM
maintenance_work_mem = 128MB
huge_pages = off
dynamic_shared_memory_type = posix

# CPU: 2 cores, short OLTP queries
max_worker_processes = 4
max_parallel_workers = 2
max_parallel_workers_per_gather = 0
max_parallel_maintenance_workers = 1
jit = off                               # compiling costs more than Airflow's queries take

# durability: never traded for speed
fsync = on
synchronous_commit = on
full_page_writes = on
wal_level = replica
wal_compression = on
max_wal_size = 1GB
min_wal_size = 80MB
checkpoint_timeout = 5min
checkpoint_completion_target = 0.9

# storage
random_page_cost = 1.1
effective_io_concurrency = 100

# logging: stderr, into the log file the server is started with
logging_collector = off
log_destination = 'stderr'
log_line_prefix = '%m [%p] %q%u@%d '
log_timezone = 'UTC'
log_lock_waits = on
log_temp_files = 16MB
log_checkpoints = on
log_min_duration_statement = 2s

# locale and time
timezone = 'UTC'
datestyle = 'iso, mdy'
lc_messages = 'C.UTF-8'
lc_monetary = 'C.UTF-8'
lc_numeric = 'C.UTF-8'
lc_time = 'C.UTF-8'
default_text_search_config = 'pg_catalog.english'
"""


def pg_hba_conf(role: str = ROLE, database: str = DATABASE, more: Sequence[tuple[str, str]] = ()) -> str:
    """Peer authentication for the superuser over the socket; SCRAM over loopback for the role and its database
    (and each further (role, database) pair in `more`); everything else refused (no line matches)."""
    pairs = [(role, database), *more]
    for name in (name for pair in pairs for name in pair):
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"unsupported role or database name {name!r}")
    hosts = "".join(f"host    {db:<9} {user:<9} 127.0.0.1/32   scram-sha-256\n" for user, db in pairs)
    return f"""\
# Written by scripts/pgstack.py; rewritten at every `make up`.
# TYPE  DATABASE  USER      ADDRESS        METHOD
local   all       {PG_USER:<9} {'':<14} peer
{hosts}"""


def sqlalchemy_url(password: str, port: int, role: str = ROLE, database: str = DATABASE,
                   host: str = "127.0.0.1") -> str:
    """The SQLAlchemy URL for Airflow. Every part is percent-quoted, so the URL parses back to the same values and
    survives Airflow's expansion of `$VAR` in environment values (`$` becomes %24)."""
    def q(value: str) -> str:
        return urllib.parse.quote(value, safe="")

    return f"postgresql+psycopg2://{q(role)}:{q(password)}@{host}:{int(port)}/{q(database)}"


def pgpass_line(password: str, port: int, role: str, database: str, host: str = "127.0.0.1") -> str:
    """One line of a libpq password file (PGPASSFILE): a client then connects with a URL that holds no password,
    so the password is in no command line, environment or log. ':' and '\\' are escaped as libpq expects."""
    def esc(value: str) -> str:
        if "\n" in value or "\r" in value:
            raise ValueError("a line break cannot be written to a password file")
        return value.replace("\\", "\\\\").replace(":", "\\:")

    return f"{esc(host)}:{int(port)}:{esc(database)}:{esc(role)}:{esc(password)}\n"


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = 4096) -> str:
    """PostgreSQL's stored form of a SCRAM-SHA-256 password (what psql's \\password sends): the server never sees
    the password itself. ASCII only, where SASLprep is the identity."""
    if not password or not all(32 <= ord(c) < 127 for c in password):
        raise ValueError("the password must be non-empty printable ASCII")
    salt = os.urandom(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def psql_quote(value: str) -> str:
    """A value as a single-quoted psql meta-command argument (for `\\set name '...'`)."""
    if "\0" in value:
        raise ValueError("NUL cannot be passed to psql")
    escaped = (value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
               .replace("\t", "\\t"))
    return f"'{escaped}'"


def provision_script(verifier: str) -> str:
    """psql script (on stdin) that creates or updates the role and its database. Names come in as the psql
    variables `role` and `db` (quoted by psql: :'x' a literal, :"x" an identifier), the verifier by `\\set`."""
    return f"""\
\\set ON_ERROR_STOP on
\\set verifier {psql_quote(verifier)}
SELECT format('CREATE ROLE %I', :'role') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \\gexec
ALTER ROLE :"role" WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'verifier';
SELECT format('CREATE DATABASE %I OWNER %I ENCODING %L TEMPLATE template0', :'db', :'role', 'UTF8')
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db') \\gexec
ALTER DATABASE :"db" OWNER TO :"role";
"""


def psql_command(sock_dir: Path, port: int, variables: Mapping[str, str] | None = None,
                 database: str = "postgres") -> list[str]:
    """psql as the superuser over the unix socket (peer authentication), the script on stdin."""
    cmd = ["runuser", "-u", PG_USER, "--", str(BIN_DIR / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
           "-h", str(sock_dir), "-p", str(int(port)), "-U", PG_USER, "-d", database]
    for name, value in (variables or {}).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"bad psql variable name {name!r}")
        cmd += ["-v", f"{name}={value}"]
    return [*cmd, "-f", "-"]


def provisioned_digest(role: str, database: str, password: str) -> str:
    return hashlib.sha256(f"{role}\0{database}\0{password}".encode()).hexdigest()


def parse_postmaster_pid(text: str) -> dict[str, str]:
    """postmaster.pid: pid, data directory, start time, port, socket directory, listen address, shared memory key,
    status ("starting", "ready", "stopping")."""
    keys = ["pid", "data_dir", "start_time", "port", "socket_dir", "listen", "shmem_key", "status"]
    lines = text.split("\n")
    return {key: lines[i].strip() for i, key in enumerate(keys) if i < len(lines) and lines[i].strip()}


def startup_message(user: str = ROLE, database: str = DATABASE) -> bytes:
    """A protocol 3.0 StartupMessage."""
    params = b"".join(f"{k}\0{v}\0".encode() for k, v in
                      (("user", user), ("database", database), ("application_name", "pgstack-ready"))) + b"\0"
    return struct.pack("!ii", 8 + len(params), 196608) + params


def server_accepts(reply: bytes) -> bool | None:
    """What the first reply to a StartupMessage says, like pg_isready: an authentication request, or any error
    but "cannot connect now" (57P03: starting up, shutting down, in recovery), means accepting connections.
    None when more bytes are needed to tell."""
    if not reply:
        return None
    kind = reply[:1]
    if kind == b"R":
        return True
    if kind != b"E":
        return False
    if len(reply) < 5:
        return None
    length = struct.unpack("!i", reply[1:5])[0]
    if len(reply) < 1 + length:
        return None
    fields = reply[5:1 + length].split(b"\0")
    code = next((f[1:].decode(errors="replace") for f in fields if f[:1] == b"C"), "")
    return code != "57P03"


# ---------------------------------------------------------------------------------------------- files
def missing_binaries() -> list[str]:
    return [b for b in REQUIRED_BINARIES if not os.access(b, os.X_OK)]


def ensure_password(secrets_dir: Path, nbytes: int = 24, name: str = PASSWORD_FILE) -> str:
    """A role's password (the `airflow` role's by default): generated once into a file that is 0600 from its first
    byte (written to a private temporary file, then linked into place, so a reader never sees it half written and
    two concurrent callers agree on one password)."""
    secrets_dir = Path(secrets_dir)
    path = secrets_dir / name
    if not path.exists():
        secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = secrets_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask: never wider, maybe narrower
            os.write(fd, secrets.token_urlsafe(nbytes).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another caller got there first: theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    password = path.read_text().strip()
    if not password:
        raise RuntimeError(f"{path} is empty: remove it to generate a new password")
    return password


def _pg_ids() -> tuple[int, int]:
    pw = pwd.getpwnam(PG_USER)
    return pw.pw_uid, pw.pw_gid


def _write_owned(path: Path, text: str, mode: int = 0o600) -> bool:
    """Write a file owned by the postgres user when its text changed; True if it did."""
    if path.exists() and path.read_text() == text:
        return False
    uid, gid = _pg_ids()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.fchown(fd, uid, gid)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    tmp.replace(path)
    return True


# ---------------------------------------------------------------------------------------------- processes
def _server_env() -> dict[str, str]:
    # Not the caller's environment: it holds Airflow's secrets.
    return {"PATH": f"{BIN_DIR}:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
            "HOME": pwd.getpwnam(PG_USER).pw_dir}


def _run_as_postgres(cmd: list[str], input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["runuser", "-u", PG_USER, "--", *cmd], input=input, text=True, capture_output=True,
                          env=_server_env(), cwd="/", timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def psql(script: str, sock_dir: Path, port: int, variables: Mapping[str, str] | None = None,
         database: str = "postgres") -> str:
    """Run a psql script as the superuser over the unix socket; the script goes on stdin. Returns stdout."""
    proc = subprocess.run(psql_command(sock_dir, port, variables, database), input=script, text=True,
                          capture_output=True, env=_server_env(), cwd="/", timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"psql failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _proc_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """True for a live process; reaps it when it is our child; a zombie counts as dead."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def postmaster_info(data_dir: Path) -> dict[str, str] | None:
    """postmaster.pid's fields when a postmaster of this data directory is alive, else None."""
    try:
        info = parse_postmaster_pid((Path(data_dir) / "postmaster.pid").read_text())
        pid = int(info["pid"])
    except (OSError, KeyError, ValueError):
        return None
    if not _alive(pid) or _proc_comm(pid) != "postgres":
        return None
    return info


def postmaster_pid(data_dir: Path) -> int | None:
    info = postmaster_info(data_dir)
    return int(info["pid"]) if info else None


def _spawn_postgres(data_dir: Path, port: int, out, extra: list[str] | None = None) -> int:
    uid, gid = _pg_ids()
    proc = subprocess.Popen(
        [str(BIN_DIR / "postgres"), "-D", str(data_dir), "-p", str(int(port)), *(extra or [])],
        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=_server_env(), cwd="/",
        user=uid, group=gid, extra_groups=os.getgrouplist(PG_USER, gid), umask=0o077,
        start_new_session=True,  # no controlling terminal: it outlives the caller and the caller's terminal
    )
    return proc.pid


def start(data_dir: Path, port: int, logfile: Path) -> int:
    """Start the postmaster as `postgres` in its own session (it is the returned pid and leads its process group);
    its log goes to logfile, opened by the caller's user. A running postmaster of data_dir is returned as is."""
    data_dir = Path(data_dir)
    running = postmaster_pid(data_dir)
    if running:
        return running
    if not (data_dir / "PG_VERSION").exists():
        raise RuntimeError(f"{data_dir} holds no PostgreSQL cluster: run ensure_cluster first")
    logfile = Path(logfile)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as out:
        return _spawn_postgres(data_dir, port, out)


def ready(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    """Accepting connections on host:port? (pg_isready's test, in Python: a StartupMessage, then the first reply.
    Closing during authentication leaves no line in the server log.)"""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(startup_message())
            reply = b""
            while True:
                verdict = server_accepts(reply)
                if verdict is not None:
                    return verdict
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False


def stop(pid: int, timeout: float = 60.0, data_dir: Path | None = None) -> bool:
    """Fast shutdown of the postmaster `pid` (SIGINT to it alone); after `timeout`, immediate shutdown (SIGQUIT).
    True when it is gone. A pid that is not a postgres process, or (with data_dir) not that cluster's postmaster,
    is left alone (False)."""
    if not _alive(pid):
        return True
    if _proc_comm(pid) != "postgres" or (data_dir is not None and postmaster_pid(data_dir) != pid):
        return False
    for sig, wait_s in ((signal.SIGINT, timeout), (signal.SIGQUIT, 15.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.1)
    return not _alive(pid)


def reload(pid: int) -> None:
    """Re-read postgresql.conf and pg_hba.conf (SIGHUP); port, listen address and memory need a restart."""
    if _proc_comm(pid) == "postgres":
        os.kill(pid, signal.SIGHUP)


def _wait_until_ready(data_dir: Path, pid: int, timeout: float) -> None:
    """Wait for the postmaster's own status line ("ready" in postmaster.pid): works without TCP."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise RuntimeError("postgres exited while starting")
        info = postmaster_info(data_dir)
        if info and info.get("pid") == str(pid) and info.get("status") == "ready":
            return
        time.sleep(0.1)
    raise RuntimeError(f"postgres did not become ready within {timeout:.0f} s")


# ---------------------------------------------------------------------------------------------- the cluster
def traversable(mode: int, owner: int, group: int, uid: int, gids: set[int]) -> bool:
    """May the user uid (groups gids) pass through a directory of this mode, owner and group? Like the kernel:
    the owner's bits for the owner, else the group's for a member, else the others'."""
    if owner == uid:
        return bool(mode & stat.S_IXUSR)
    if group in gids:
        return bool(mode & stat.S_IXGRP)
    return bool(mode & stat.S_IXOTH)


def blocking_ancestor(path: Path, uid: int, gids: set[int]) -> Path | None:
    """The first directory above `path` that the user uid (groups gids) cannot traverse, or None."""
    for parent in reversed(Path(path).absolute().parents):
        try:
            st = parent.stat()
        except FileNotFoundError:
            return None  # made below by the caller's user
        if not traversable(st.st_mode, st.st_uid, st.st_gid, uid, gids):
            return parent
    return None


def _initdb(data_dir: Path, log: Log) -> None:
    uid, gid = _pg_ids()
    for parent in reversed(data_dir.absolute().parents):
        if not parent.exists():
            parent.mkdir()
            parent.chmod(0o755)  # whatever the umask: the postgres user must pass through
    blocked = blocking_ancestor(data_dir, uid, set(os.getgrouplist(PG_USER, gid)))
    if blocked:
        raise RuntimeError(f"the {PG_USER} user cannot reach {data_dir}: {blocked} is not traversable for it "
                           "(put the data directory under the profile's cluster_dir, not under .state/)")
    if data_dir.exists() and any(data_dir.iterdir()):
        raise RuntimeError(f"{data_dir} is not empty and holds no PostgreSQL cluster (no PG_VERSION): not touching it")
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chown(data_dir, uid, gid)
    data_dir.chmod(0o700)
    log(f"postgres: initialising a cluster in {data_dir}")
    _run_as_postgres([str(BIN_DIR / "initdb"), "-D", str(data_dir), "--username", PG_USER, "--encoding", "UTF8",
                      "--locale", "C.UTF-8", "--auth-local", "peer", "--auth-host", "scram-sha-256"])


def _provision(data_dir: Path, port: int, password: str, log: Log, login: Login = AIRFLOW_LOGIN) -> None:
    script = provision_script(scram_verifier(password))
    variables = {"role": login.role, "db": login.database}
    info = postmaster_info(data_dir)
    if info:  # the running server, on the port and socket it was started with
        psql(script, Path(info["socket_dir"]), int(info["port"]), variables)
        return
    # A temporary server on the unix socket only (no TCP), stopped again afterwards.
    with tempfile.TemporaryFile() as out:
        pid = _spawn_postgres(data_dir, port, out, ["-c", "listen_addresses="])
        try:
            _wait_until_ready(data_dir, pid, 60)
            psql(script, socket_dir(data_dir), port, variables)
        except Exception as exc:
            out.seek(0)
            tail = out.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"{exc}; server log:\n{tail}") from exc
        finally:
            if not stop(pid):
                log(f"postgres: the temporary server (pid {pid}) did not stop")


def provisioned_stamp(login: Login) -> str:
    """The data directory's record of a login's role, database and password (the airflow one keeps its name)."""
    return PROVISIONED_STAMP if login == AIRFLOW_LOGIN else f"{PROVISIONED_STAMP}-{login.role}"


def ensure_cluster(data_dir: Path, port: int, secrets_dir: Path, log: Log, more_logins: Sequence[Login] = ()) -> str:
    """Idempotently: initdb a cluster owned by `postgres` in data_dir, (re)write its configuration, create or
    update the role and database `airflow` (and each of `more_logins`) with the password from secrets_dir. Returns
    the SQLAlchemy URL of `airflow`. Works with the server stopped (a temporary socket-only server does the SQL)
    or running (reloaded when its configuration changed). The parents of data_dir must be traversable by the
    postgres user. Every caller must name the same `more_logins`: pg_hba.conf lets in only the logins named."""
    missing = missing_binaries()
    if missing:
        raise RuntimeError(f"PostgreSQL is not installed (missing {', '.join(missing)}): "
                           f"apt-get install {' '.join(APT_PACKAGES)}")
    data_dir = Path(data_dir)
    if not (data_dir / "PG_VERSION").exists():
        _initdb(data_dir, log)
    uid, gid = _pg_ids()
    sock_dir = socket_dir(data_dir)
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    os.chown(sock_dir, uid, gid)
    sock_dir.chmod(0o700)
    changed = _write_owned(data_dir / "postgresql.conf", postgresql_conf(port, sock_dir))
    changed |= _write_owned(data_dir / "pg_hba.conf",
                            pg_hba_conf(more=[(login.role, login.database) for login in more_logins]))
    running = postmaster_pid(data_dir)
    if changed and running:
        log("postgres: configuration changed; reloaded (a changed port or memory setting needs down/up)")
        reload(running)
    for login in (AIRFLOW_LOGIN, *more_logins):
        password = ensure_password(secrets_dir, name=login.password_file)
        stamp = data_dir / provisioned_stamp(login)
        digest = provisioned_digest(login.role, login.database, password)
        if not stamp.exists() or stamp.read_text().strip() != digest:
            log(f"postgres: creating or updating role {login.role} and database {login.database}")
            _provision(data_dir, port, password, log, login)
            _write_owned(stamp, digest + "\n")
    return sqlalchemy_url(ensure_password(secrets_dir), port)

