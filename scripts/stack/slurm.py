"""Slurm on this machine: munge, the private MariaDB for accounting, slurmdbd, slurmctld and one slurmd per node."""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .common import (
    JOB_USER,
    PROFILE,
    STACK,
    P,
    Service,
    ensure_dir,
    log,
    pid_alive,
    port_open,
    proc_comm,
    read_pid,
    run,
    secret,
    spawn,
    stop_pid,
    wait_for,
    wait_pidfile,
    write_if_changed,
)

# ---------------------------------------------------------------------------------------------------------------- nodes
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


# ---------------------------------------------------------------------------------------------------------------- munge
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


# -------------------------------------------------------------------------------------------------------------- mariadb
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


# ---------------------------------------------------------------------------------------------------------------- slurm
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
# No event starts the scheduler when a requeued job becomes eligible: the backfill pass does (default every 30 s;
# measured: 11-29 s of a healed stall's 2 minutes were this wait).
SchedulerParameters=bf_interval=5
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


# The one-node versions' slurmd service: only its pid file is still read (`up` and `down` stop that slurmd).
LEGACY_SLURMD = Service("slurmd", lambda: False, lambda: None, comm="slurmd")
# The services that read the Slurm configs: `up` reconciles those first when it starts any of them.
SLURM_SERVICES = ("slurmdbd", "slurmctld", "slurmd-")


def services() -> list[Service]:
    """munge, MariaDB, slurmdbd, slurmctld and one slurmd per node, in the order they start."""
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
    ]
