"""The machine's side of the stack: Debian packages, the job and service users, the state directory, SSH client key,
shared storage, the cluster's job environment and the jobs shipped to it."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pgstack

from .common import (
    JOB_USER,
    REPO,
    SERVICE_USER,
    STATE,
    STORAGE_GROUP,
    VENV,
    P,
    as_user,
    ensure_dir,
    log,
    run,
    write_if_changed,
)

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
