"""Security scenarios on the running local stack.

10: hostile values for every string param of every DAG are refused by the schema or stay inert data.
12: services listen on loopback only (Slurm daemons excepted), Airflow (its tasks and their Spark drivers
    included), Spark and the Slurm jobs run unprivileged, and no generated secret shows up in task logs, reports,
    alerts, XCom, rendered fields or tracked files.
Each scenario prints one `RELIABILITY <scenario> key=value ...` line (the README quotes them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy
from airflow_api import trigger
from helpers.rest import call, local_api_when_up, remove_run

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state"))

pytestmark = [pytest.mark.slow, pytest.mark.integration]

# slurmctld and slurmd bind to 127.0.0.1 (CommunicationParameters=NoCtldInAddrAny,NoInAddrAny); slurmdbd 22.05
# has no bind-address setting and listens on the wildcard address: the one known exception.
SLURM_WILDCARD_PORTS = {6819}
RUN_PREFIX = "reliability_hostile__"
# Valid values for params that have no default, so that a refusal names the hostile param. The job id is one
# Slurm does not know: the on-call DAG then refuses without touching any job.
REQUIRED_VALUES = {"oncall_training_job": {"job_id": "999999999", "reason": "reliability probe"},
                   # a run let through releases a version of no model: it fails at once, touching nothing
                   "release_model": {"model_name": "hostile_params_no_such_model", "version": 1}}


@pytest.fixture(scope="module")
def api(stack):
    return local_api_when_up()


# --- 10: hostile params -----------------------------------------------------------------------------------

def hostile_values(tag: str) -> dict[str, object]:
    marker = f"/tmp/pwned-{tag}"
    return {
        "semicolon": f"x; touch {marker}",
        "subshell": f"$(touch {marker})",
        "backticks": f"`touch {marker}`",
        "newline": f"x\ntouch {marker}\n",
        "sbatch_option": f"--wrap=touch {marker}",
        "path_traversal": "../../etc/passwd",
        "huge": "A" * 100_000,
        "wrong_type_list": [f"touch {marker}"],
        "wrong_type_object": {"cmd": f"touch {marker}"},
    }


def string_params(api) -> dict[str, dict]:
    found = {}
    for dag in api.get("/api/v2/dags?limit=100")["dags"]:
        details = api.get(f"/api/v2/dags/{dag['dag_id']}/details")
        params = details.get("params") or {}
        found[dag["dag_id"]] = {
            "paused": dag["is_paused"],
            "manual_only": details.get("timetable_summary") in (None, "None"),
            "all_params": set(params),
            "params": {name: spec for name, spec in params.items()
                       if "string" in str((spec.get("schema") or {}).get("type"))},
        }
    return found


def marker_files() -> tuple[list[str], list[str]]:
    """Marker files a hostile value would have made here and on the cluster's login node. Each look uses a
    connection of its own: one held idle through minutes of DAG runs once stalled opening its next channel
    (paramiko "Timeout opening channel" after 120 s, CI 2026-12-05), which says nothing about the params."""
    from hybridflow.hooks.slurm import SlurmHook

    local = sorted(str(p) for p in Path("/tmp").glob("pwned-*"))
    slurm = SlurmHook()
    try:
        remote = slurm.run(["sh", "-c", "ls -d /tmp/pwned-* 2>/dev/null; ls -d ~/pwned-* 2>/dev/null; true"])
    finally:
        slurm.close()
    return local, remote.stdout.split()


def test_hostile_params_are_refused_or_inert(api, stack):
    assert marker_files() == ([], []), "marker files exist before the test"
    dags = string_params(api)
    refused, accepted, created, unpaused = 0, [], [], []
    try:
        for dag_id, info in dags.items():
            for param in info["params"]:
                for kind, value in hostile_values(f"{dag_id}-{param}").items():
                    run_id = f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}"
                    conf = {**REQUIRED_VALUES.get(dag_id, {}), param: value}
                    if "dry_run" in info["all_params"]:
                        conf["dry_run"] = True
                    status, body = call(api, "POST", f"/api/v2/dags/{dag_id}/dagRuns",
                                        {"dag_run_id": run_id, "logical_date": None, "conf": conf})
                    if status == 400:
                        assert f"param {param}" in str(body.get("detail")), (dag_id, param, kind, body)
                        refused += 1
                        continue
                    assert status < 300, (dag_id, param, kind, status, body)
                    created.append((dag_id, run_id))
                    accepted.append((dag_id, param, kind, info["paused"], "dry_run" in conf))
        # Accepted runs execute: a paused manual-only DAG is unpaused for them (and paused again below).
        for dag_id in {a[0] for a in accepted if a[3] and dags[a[0]]["manual_only"]}:
            call(api, "PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
            unpaused.append(dag_id)
        waited_on = [(d, r) for (d, r), a in zip(created, accepted, strict=True)
                     if not a[3] or a[0] in unpaused]
        deadline = time.monotonic() + 180
        states = {}
        while waited_on and time.monotonic() < deadline:
            states = {r: call(api, "GET", f"/api/v2/dags/{d}/dagRuns/{r}")[1].get("state")
                      for d, r in waited_on}
            if all(s in ("success", "failed") for s in states.values()):
                break
            time.sleep(5)
        local, remote = marker_files()
        print(f"RELIABILITY hostile_params dags={len(dags)} string_params="
              f"{sum(len(i['params']) for i in dags.values())} posts={refused + len(accepted)} "
              f"refused_400={refused} accepted={len(accepted)} executed={len(waited_on)} "
              f"finished={sum(s in ('success', 'failed') for s in states.values())} "
              f"markers_local={len(local)} markers_cluster={len(remote)}")
        for item in accepted:
            print(f"  accepted dag={item[0]} param={item[1]} value={item[2]} paused={item[3]} "
                  f"dry_run={item[4]}")
        assert local == [] and remote == [], (local, remote)
    finally:
        for dag_id in unpaused:
            call(api, "PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": True})
        for dag_id, run_id in created:
            remove_run(api, dag_id, run_id)


# --- 12a: loopback-only listeners -------------------------------------------------------------------------

def process_tree(roots: set[int]) -> set[int]:
    parent = {}
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    for line in table.splitlines():
        pid, ppid = map(int, line.split())
        parent[pid] = ppid
    tree = set(roots)
    changed = True
    while changed:
        grown = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= grown
        changed = bool(grown)
    return tree


def service_pids() -> dict[int, str]:
    owners = {}
    for pid_file in sorted((STATE / "run").glob("*.pid")):
        try:
            root = int(pid_file.read_text().split()[0])
        except (ValueError, IndexError):
            continue
        for pid in process_tree({root}):
            owners[pid] = pid_file.stem
    return owners


def listeners() -> list[tuple[str, int, int | None]]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        address, port = fields[3].rsplit(":", 1)
        pids = [int(p) for p in re.findall(r"pid=(\d+)", line)] or [None]
        found.extend((address.strip("[]"), int(port), pid) for pid in pids)
    return found


def is_loopback(address: str) -> bool:
    return address in ("127.0.0.1", "::1", "::ffff:127.0.0.1") or address.startswith("127.")


def uid_of(pid: int) -> int | None:
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def comm(pid: int | None) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, TypeError):
        return "?"


def exposed_listeners(before: set[tuple[str, int]], job_uid: int) -> tuple[list, list]:
    """(every listener of a process the stack started or of its children, the non-loopback ones among all
    listeners that were not there before the stack's snapshot, but the Slurm jobs')."""
    owners = service_pids()
    found = listeners()
    ours = [(a, p, pid, owners[pid]) for a, p, pid in found if pid in owners]
    # A listener of no pid file's tree (a daemon that forked away, a task's child re-parented) still counts
    # unless it was already listening before this test looked: nothing new may take a non-loopback address.
    # A Slurm job's ranks (the job user's processes, another test's job beside this one) listen for their peers
    # on other nodes: that is the cluster's network, not a service of the stack.
    stray = [(a, p, pid, comm(pid)) for a, p, pid in found
             if pid not in owners and not is_loopback(a) and (a, p) not in before and uid_of(pid) != job_uid]
    return ours, stray


def test_services_and_task_launched_spark_drivers_listen_on_loopback_only_except_slurmdbd(api):
    """Every socket of every process `make up` started and of every child, sampled while a DAG run launches a
    Spark driver (spark-submit in client mode under the scheduler's LocalExecutor): 127.0.0.1 only. The same
    samples check who runs them: every process of Airflow's and Spark's trees (task processes and drivers
    included) is the unprivileged service user, never root."""
    import pwd

    service_uid = pwd.getpwnam(os.environ.get("HYBRIDFLOW_SERVICE_USER", "hybridflow")).pw_uid
    job_uid = pwd.getpwnam(os.environ.get("HYBRIDFLOW_JOB_USER", "mlops")).pw_uid
    identities: dict[int, tuple[str, str, int | None]] = {}
    owners = service_pids()
    before = {(a, p) for a, p, pid in listeners() if pid not in owners}
    run_id = trigger(api, "platform_healthcheck", {"run_spark": True})
    seen: dict[tuple, str] = {}
    stray: dict[tuple, str] = {}
    drivers = set()
    deadline = time.monotonic() + 300
    state = None
    while time.monotonic() < deadline:
        ours, new_stray = exposed_listeners(before, job_uid)
        for a, p, pid, owner in ours:
            seen[(a, p, owner)] = comm(pid)
            if owner.startswith("airflow") and comm(pid) == "java":
                drivers.add((a, p))
        stray.update({(a, p): c for a, p, _, c in new_stray})
        for pid, owner in service_pids().items():
            if owner.startswith(("airflow", "spark")) and uid_of(pid) is not None:
                identities[pid] = (owner, comm(pid), uid_of(pid))
        state = api.get(f"/api/v2/dags/platform_healthcheck/dagRuns/{run_id}")["state"]
        if state in ("success", "failed"):
            break
        time.sleep(0.3)
    exposed = sorted((owner, a, p) for a, p, owner in seen if not is_loopback(a))
    print(f"RELIABILITY loopback_listeners service_sockets={len(seen)} "
          f"loopback={sum(is_loopback(a) for a, _, _ in seen)} spark_driver_sockets={len(drivers)} "
          f"non_loopback={','.join(f'{o}:{a}:{p}' for o, a, p in exposed) or 'none'} "
          f"new_non_loopback_outside_the_stack={','.join(f'{c}:{a}:{p}' for (a, p), c in stray.items()) or 'none'}")
    privileged = sorted({(o, c, u) for o, c, u in identities.values() if u != service_uid})
    print(f"RELIABILITY service_user uid={service_uid} processes={len(identities)} "
          f"airflow_java={sum(o.startswith('airflow') and c == 'java' for o, c, _ in identities.values())} "
          f"not_service_user={','.join(f'{o}:{c}:{u}' for o, c, u in privileged) or 'none'}")
    assert state == "success", f"platform_healthcheck run {run_id} ended {state}"
    assert drivers, "no task-launched Spark driver socket was seen: the sample did not cover the driver"
    assert any(o.startswith("airflow") and c == "java" for o, c, _ in identities.values()), identities
    assert {o.split("-")[0] for o, _, _ in identities.values()} == {"airflow", "spark"}, identities
    assert not privileged, f"processes of Airflow or Spark not running as uid {service_uid}: {privileged}"
    assert all(is_loopback(a) for a, _ in drivers), drivers
    assert {p for _, _, p in exposed} <= SLURM_WILDCARD_PORTS, exposed
    assert {o for o, _, _ in exposed} <= {"slurmdbd"}, exposed
    assert not stray, stray


# --- 12b: unprivileged jobs ---------------------------------------------------------------------------------

def test_slurm_jobs_run_as_the_unprivileged_job_user(stack):
    from hybridflow.hooks.slurm import SlurmHook

    done = SlurmHook().run(["srun", "--immediate=60", "--time=1", "-N1", "-n1", "sh", "-c",
                            "echo uid=$(id -u) user=$(id -un)"], timeout_s=120)
    assert done.returncode == 0, done.stderr
    fields = dict(item.split("=", 1) for item in done.stdout.split())
    print(f"RELIABILITY job_user uid={fields['uid']} user={fields['user']}")
    assert int(fields["uid"]) != 0
    assert fields["user"] == stack.get("HYBRIDFLOW_JOB_USER", "mlops")


# --- 12c: no secrets at rest ------------------------------------------------------------------------------


def test_state_is_for_root_only_and_secret_files_are_0600(stack):
    """Keys, tokens, passwords and logs live under .state: root's, passable (0710) only by the service user's
    group, to reach its own Airflow home, SSH key and Spark folders; everything else root's; no secret file
    open to group or others."""
    import grp
    import pwd

    service = pwd.getpwnam(stack.get("HYBRIDFLOW_SERVICE_USER", "hybridflow"))
    assert (STATE.stat().st_uid, STATE.stat().st_gid, STATE.stat().st_mode & 0o777) == (0, service.pw_gid, 0o710)
    assert set(grp.getgrgid(service.pw_gid).gr_mem) <= {service.pw_name, stack.get("HYBRIDFLOW_JOB_USER", "mlops")}
    for sub in ("run", "logs", "secrets"):
        assert (STATE / sub).stat().st_uid == 0, f"{STATE / sub} is not root's"
    for sub in ("ssh", "airflow", "spark"):
        assert (STATE / sub).stat().st_uid == service.pw_uid, f"{STATE / sub} is not {service.pw_name}'s"
    for sub in ("run", "logs", "secrets", "ssh", "airflow", "spark"):
        assert (STATE / sub).stat().st_mode & 0o077 == 0, f"{STATE / sub} is open to group or others"
    secret_files = [*(STATE / "secrets").iterdir(), STATE / "ssh" / "id_ed25519", STATE / "airflow-env.json",
                    STATE / "airflow" / "passwords.json", STATE / "airflow" / "airflow.cfg",
                    *Path(stack.get("HYBRIDFLOW_CLUSTER_DIR", "/var/lib/hybridflow"), "secrets").iterdir()]
    wide = {str(p): oct(p.stat().st_mode & 0o777) for p in secret_files if p.stat().st_mode & 0o077}
    print(f"RELIABILITY secret_files checked={len(secret_files)} open_to_others={len(wide)}")
    assert not wide, wide


def generated_secrets(stack: dict[str, str]) -> dict[str, str]:
    secrets = {f"secrets/{p.name}": p.read_text().strip()
               for p in (STATE / "secrets").iterdir() if p.is_file()}
    key_lines = [ln for ln in (STATE / "ssh" / "id_ed25519").read_text().splitlines()
                 if ln and not ln.startswith("-----")]
    for i, line in enumerate(key_lines):
        secrets[f"ssh_private_key_line{i}"] = line
    for user, password in json.loads((STATE / "airflow" / "passwords.json").read_text()).items():
        secrets[f"password:{user}"] = password
    for name in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
        if stack.get(name):
            secrets[name] = stack[name]
    s3 = json.loads(stack["AIRFLOW_CONN_STORAGE_S3"])
    for key in ("login", "password"):
        if s3.get(key):
            secrets[f"s3:{key}"] = s3[key]
    return {k: v for k, v in secrets.items() if len(v) >= 12}


def test_no_generated_secret_in_logs_reports_xcom_or_tracked_files(stack):
    secrets = generated_secrets(stack)
    assert len(secrets) >= 5, sorted(secrets)
    needles = {v.encode(): k for k, v in secrets.items()}
    storage = Path(stack.get("HYBRIDFLOW_STORAGE_ROOT", "/var/lib/hybridflow/storage"))
    log_root = Path(stack["AIRFLOW_HOME"]) / "logs"
    cfg = (Path(stack["AIRFLOW_HOME"]) / "airflow.cfg")
    if cfg.exists():
        match = re.search(r"^base_log_folder\s*=\s*(\S+)", cfg.read_text(), re.M)
        log_root = Path(match.group(1)) if match else log_root
    places = {"task_logs": log_root, "reports": storage / "reports", "alerts": storage / "alerts"}
    hits: list[str] = []
    scanned = {}
    for place, folder in places.items():
        files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
        scanned[place] = len(files)
        for path in files:
            data = path.read_bytes()
            hits += [f"{place}:{path}:{name}" for needle, name in needles.items() if needle in data]

    # The stack's metadata database, whichever it is (PostgreSQL, or SQLite when asked for).
    engine = sqlalchemy.create_engine(stack["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    try:
        with engine.connect() as db:
            for table, column in (("xcom", "value"), ("rendered_task_instance_fields", "rendered_fields")):
                rows = db.execute(sqlalchemy.text(f"SELECT {column} FROM {table}")).fetchall()  # noqa: S608
                scanned[table] = len(rows)
                for (value,) in rows:
                    data = value if isinstance(value, bytes) else str(value).encode()
                    hits += [f"{table}:{name}" for needle, name in needles.items() if needle in data]
    finally:
        engine.dispose()

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    paths = [REPO / p for p in tracked.decode().split("\0") if p]
    scanned["tracked_files"] = len(paths)
    for path in paths:
        if path.is_file():
            data = path.read_bytes()
            hits += [f"git:{path.relative_to(REPO)}:{name}"
                     for needle, name in needles.items() if needle in data]
    print(f"RELIABILITY secrets_at_rest secrets={len(secrets)} "
          + " ".join(f"{k}={v}" for k, v in scanned.items()) + f" hits={len(hits)}")
    assert scanned["task_logs"] > 0, f"no task logs found under {log_root}"
    assert not hits, hits
