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

# This file is the command line and the order of the services; each service (how to start it, when it is ready, its
# configs) lives in a module of scripts/stack/.

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import pwd
import shlex
import subprocess
import sys
import time

import mlflowstack  # scripts/ is on sys.path: this script's own folder (so is the stack package)
import pgstack
from stack import airflow, mlflow, postgres, s3, slurm, spark, sshd, system, triton
from stack.common import (
    METADATA_DB,
    SERVICE_USER,
    STACK,
    STATE,
    P,
    Service,
    ensure_dir,
    log,
    port_open,
    proc_uid,
    stop_pid,
    wait_for,
)

SERVICE_USER_SERVICES = ("airflow-", "spark-")


def services() -> list[Service]:
    """Every service, in the stack's order: `up` starts them in it (Airflow's components first), `down` stops them
    in reverse."""
    return [*slurm.services(), *sshd.services(), *spark.services(), *triton.services(), *s3.services(),
            *postgres.services(), *mlflow.services(), *airflow.services()]


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
    system.ensure_packages()
    system.ensure_job_user()
    system.ensure_service_user()
    system.ensure_state_dir()
    # Keys, passwords, tokens and the logs that could echo them: for root only.
    for d in (P.run_dir, P.logs, P.local_secrets):
        ensure_dir(d, mode=0o700)
    system.ensure_checkout_reachable()
    system.ensure_storage()
    system.ensure_client_key()
    system.ensure_cluster_env()
    system.deploy_jobs()
    airflow.write_airflow_files()
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
        airflow.migrate_airflow_db()
    if any(s.name.startswith(slurm.SLURM_SERVICES) for s in chosen) and slurm.reconcile_slurm_config():
        # Restarted on a changed configuration: the controller and every node come back, whatever was asked.
        wanted = {s.name for s in chosen}
        chosen = [s for s in services() if s.name in wanted or s.name == "slurmctld" or s.name.startswith("slurmd-")]
    unguarded = triton.UNGUARDED_TRITON.owned_pid() if any(s.name == "triton" for s in chosen) else None
    if unguarded:
        log("triton: replacing the server started without the guard")
        stop_pid("triton", unguarded)
    pending: list[Service] = []
    started: set[str] = set()
    env_digest = hashlib.sha256(json.dumps(airflow.airflow_env(), sort_keys=True).encode()).hexdigest()
    # What a running Airflow component or MLflow server was started with: it keeps that until restarted.
    digests = {svc.name: env_digest if svc.name.startswith("airflow") else mlflow.mlflow_config_digest()
               for svc in chosen if svc.name.startswith("airflow") or svc.name == "mlflow"}
    # Airflow's components are the slowest to start and need nothing from the cluster: start them first.
    for svc in sorted(chosen, key=lambda svc: not svc.name.startswith("airflow")):
        stamp = P.run_dir / f"{svc.name}.env"
        if svc.name.startswith("slurmd-") and "slurmctld" in started and svc.owned_pid():
            # A controller that just started has not heard from the running slurmds yet (their nodes show unknown
            # or not responding): let them register before judging them; restarting one would abort its job steps.
            node = svc.name.removeprefix("slurmd-")
            try:
                wait_for(f"{node} registering with slurmctld", lambda node=node: slurm.node_registered(node), 30)
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
    airflow.reap_orphaned_executor_workers()
    if db_started_at is not None:
        airflow.restart_airflow_that_lost_its_database([s for s in chosen if s.name in airflow.AIRFLOW_HEARTBEATS],
                                                       db_started_at)
    mlflow_server = by_name(["mlflow"])[0]
    if started & {"s3", "mlflow"} and mlflow_server.owned_pid():
        mlflow.ensure_mlflow_bucket(mlflow.write_mlflow_files())
    if any(s.name == "mlflow" for s in chosen) and mlflow_server.owned_pid():
        mlflow.ensure_mlflow_accounts()
        airflow.import_file_registry()
    log(f"up in {time.monotonic() - t0:.1f} s")
    return cmd_status(names, as_json=False)


def cmd_down(names: list[str]) -> int:
    chosen = by_name(names)
    if any(s.name.startswith("slurmd-") for s in chosen):
        chosen.append(slurm.LEGACY_SLURMD)  # a slurmd started by a one-node version (stopped first: reversed below)
    if any(s.name == "triton" for s in chosen) and triton.UNGUARDED_TRITON.owned_pid():
        chosen = [s for s in chosen if s.name != "triton"] + [triton.UNGUARDED_TRITON]  # started without the guard
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
        airflow.reap_orphaned_executor_workers()
    return 0


# A service is DOWN only when this many probes, PROBE_INTERVAL_S apart, all miss it: on 2 busy cores one probe can
# miss a healthy server (a slow answer, sshd shedding a burst of connections), and a status that cries wolf is
# ignored (CI 2026-12-07: `status` said a service was down in the middle of the suite; the next test used them all).
STATUS_PROBES = 3
PROBE_INTERVAL_S = 2.0


def answers(svc: Service) -> bool:
    try:
        return svc.ready()
    except OSError:  # a probe that raises (a connection reset) is a miss
        return False


def services_up(chosen: list[Service]) -> set[str]:
    """The names of the services that answered one of ``STATUS_PROBES`` rounds of probes; only those that missed
    are probed again, so a stack that is down reports in seconds."""
    up: set[str] = set()
    for attempt in range(STATUS_PROBES):
        if attempt:
            time.sleep(PROBE_INTERVAL_S)
        up |= {svc.name for svc in chosen if svc.name not in up and answers(svc)}
        if len(up) == len(chosen):
            break
    return up


def cmd_status(names: list[str], as_json: bool) -> int:
    rows = []
    chosen = by_name(names)
    up_names = services_up(chosen)
    for svc in chosen:
        up = svc.name in up_names
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
            print(f"MLflow UI: {mlflow.mlflow_url()}  login: {mlflowstack.ADMIN_USERNAME}, password in "
                  f"{P.local_secrets / 'mlflow-admin-password'} (Airflow's user: {mlflow.MLFLOW_CLIENT_USER})")
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
