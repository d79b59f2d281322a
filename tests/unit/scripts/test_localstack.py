"""The local stack's pure parts (scripts/localstack.py and its services in scripts/stack/): profile placeholders,
the rendered configs, the service list, and the file and process helpers."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import localstack  # pytest puts scripts/ on sys.path (pythonpath in pyproject.toml), and so the stack package
import mlflowstack
import pgstack
import pytest
from stack import airflow, common, mlflow, postgres, slurm, sshd

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "node, expected",
    [
        ("${ssh_port}", 2222),  # a whole placeholder keeps its type: ports stay ints in the connection
        ("http://127.0.0.1:${ssh_port}", "http://127.0.0.1:2222"),
        ({"a": ["${job_user}", 1]}, {"a": ["mlops", 1]}),
        (False, False),
        ("no placeholder", "no placeholder"),
    ],
)
def test_localstack_fill_placeholders(node, expected):
    assert airflow.fill_placeholders(node, {"ssh_port": 2222, "job_user": "mlops"}) == expected


@pytest.mark.parametrize("node", ["${missing}", "x-${missing}", "${"])
def test_localstack_unknown_placeholder_names_the_profile(node):
    with pytest.raises(RuntimeError, match="profile .*local.json"):
        airflow.fill_placeholders(node, {"ssh_port": 2222})


def test_localstack_profile_has_no_secrets_and_verifies_host_keys():
    profile = json.loads((REPO / "include/profiles/local.json").read_text())
    ssh = profile["connections"]["slurm_ssh"]
    assert ssh["extra"]["no_host_key_check"] is False
    assert ssh["extra"]["host_key"] == "${ssh_host_key}"
    for conn_id, conn in profile["connections"].items():
        assert conn.get("password", "${").startswith("${"), f"{conn_id}: password must come from generated state"


def test_localstack_profile_names_the_mlflow_server_by_placeholders():
    profile = json.loads((REPO / "include/profiles/local.json").read_text())
    conn = profile["connections"]["mlflow_default"]
    assert conn["conn_type"] == "http" and conn["host"] == "127.0.0.1" and conn["schema"] == "http"
    assert conn["port"] == "${mlflow_port}"
    assert (conn["login"], conn["password"]) == ("${mlflow_login}", "${mlflow_password}")
    stack = profile["stack"]
    used = {v for k, v in stack.items() if k.endswith("_port") and k != "mlflow_port"}
    assert stack["mlflow_port"] not in used | {8010, 6817, 6818, 6819, 16821, 16822}


def test_localstack_mlflow_store_has_no_password_in_its_uri():
    tracking, auth = mlflow.mlflow_store_uris()
    assert tracking == auth == "postgresql+psycopg2://mlflow@127.0.0.1:5433/mlflow"
    assert mlflow.mlflow_artifacts_destination() == "s3://hybridflow-mlflow"


def test_localstack_mlflow_store_is_sqlite_without_postgres(monkeypatch):
    monkeypatch.setattr(mlflow, "METADATA_DB", "sqlite")
    tracking, auth = mlflow.mlflow_store_uris()
    assert tracking.startswith("sqlite:////") and tracking.endswith("/mlflow/mlflow.db")
    assert auth.endswith("/mlflow/auth.db")


@pytest.fixture
def fake_secrets(monkeypatch):
    """Generated secrets without touching .state: each named after its file."""
    monkeypatch.setattr(mlflow, "secret", lambda name, where, nbytes=24, make=None: f"generated-{name}-0123")
    monkeypatch.setattr(pgstack, "ensure_password", lambda where, nbytes=24, name="": f"pg-{name}-0123")


def test_localstack_mlflow_files_hold_the_generated_secrets_the_command_does_not(fake_secrets):
    files = {path.name: text for path, text in mlflow.mlflow_files().items()}
    assert sorted(files) == ["auth.ini", "aws-credentials", "pgpass"]
    assert "admin_password = generated-mlflow-admin-password-0123" in files["auth.ini"]
    assert files["pgpass"] == "127.0.0.1:5433:mlflow:mlflow:pg-postgres-mlflow-0123\n"
    assert "aws_secret_access_key = generated-s3-secret-key-0123" in files["aws-credentials"]
    exposed = " ".join(mlflow.mlflow_command()) + " ".join(mlflow.mlflow_server_env().values())
    assert "-0123" not in exposed.replace("generated-mlflow-flask-secret-key-0123", "")


def test_localstack_mlflow_restarts_when_what_it_reads_changed(fake_secrets, monkeypatch):
    first = mlflow.mlflow_config_digest()
    assert mlflow.mlflow_config_digest() == first
    monkeypatch.setitem(common.STACK, "mlflow_workers", 2)
    assert mlflow.mlflow_config_digest() != first
    monkeypatch.setitem(common.STACK, "mlflow_workers", 1)
    monkeypatch.setattr(mlflowstack, "auth_ini", lambda uri, password: "[mlflow]\n")
    assert mlflow.mlflow_config_digest() != first


def test_localstack_runs_mlflow_as_a_service_after_its_stores():
    services = [svc.name for svc in localstack.services()]
    assert services.index("mlflow") > services.index("s3") and services.index("mlflow") > services.index("postgres")
    server = localstack.by_name(["mlflow"])[0]
    assert server.comm == "mlflow" and server.endpoint == "http://127.0.0.1:5000"
    assert server.logfile.name == "mlflow.log"
    assert postgres.POSTGRES_MORE_LOGINS == [pgstack.Login("mlflow", "mlflow", "postgres-mlflow")]


def test_localstack_profile_names_two_slurm_nodes():
    stack = json.loads((REPO / "include/profiles/local.json").read_text())["stack"]
    assert stack["slurm_nodes"] == ["gpu-node-01", "gpu-node-02"]
    assert "slurm_node" not in stack


@pytest.mark.parametrize(
    "stack, expected",
    [
        ({"slurm_nodes": ["a-01", "b-02"]}, ["a-01", "b-02"]),
        ({"slurm_node": "gpu-node-01"}, ["gpu-node-01"]),  # a profile copied from a one-node version
    ],
)
def test_localstack_slurm_nodes_from_profile(stack, expected):
    assert slurm.slurm_nodes(stack) == expected


@pytest.mark.parametrize("nodes", [[], ["n1", "n1"], ["n/1"], ["n 1"], "gpu-node-01", [1], None])
def test_localstack_slurm_nodes_rejects_bad_lists(nodes):
    with pytest.raises(SystemExit, match="slurm_nodes"):
        slurm.slurm_nodes({"slurm_nodes": nodes})


def _node_lines(conf: str) -> dict[str, dict[str, str]]:
    nodes = {}
    for line in conf.splitlines():
        if line.startswith("NodeName="):
            fields = dict(word.split("=", 1) for word in line.split())
            nodes[fields["NodeName"]] = fields
    return nodes


def test_localstack_slurm_conf_declares_both_partitions_and_gpus():
    conf = slurm.slurm_conf()
    lines = conf.splitlines()
    assert "GresTypes=gpu" in lines
    assert any(line.startswith("PartitionName=gpu-training ") for line in lines)
    assert any(line.startswith("PartitionName=cpu ") and "Default=YES" in line for line in lines)
    nodes = _node_lines(conf)
    assert list(nodes) == ["gpu-node-01", "gpu-node-02"]
    for node in nodes.values():
        assert node["Gres"] == "gpu:h200:8" and node["NodeAddr"] == "127.0.0.1"
        assert node["CPUs"] == "8" and node["RealMemory"] == "20000"


def test_localstack_slurm_conf_gives_each_node_its_own_port():
    nodes = _node_lines(slurm.slurm_conf())
    ports = [node["Port"] for node in nodes.values()]
    assert len(set(ports)) == len(ports) == 2
    assert "6817" not in ports and "6819" not in ports  # slurmctld and slurmdbd
    assert {node["NodeHostname"] for node in nodes.values()} == {socket.gethostname().split(".")[0]}


def test_localstack_slurm_conf_puts_every_node_in_both_partitions():
    partitions = {
        fields["PartitionName"]: fields["Nodes"].split(",")
        for fields in (dict(word.split("=", 1) for word in line.split())
                       for line in slurm.slurm_conf().splitlines() if line.startswith("PartitionName="))
    }
    assert partitions == {"cpu": ["gpu-node-01", "gpu-node-02"], "gpu-training": ["gpu-node-01", "gpu-node-02"]}


def test_localstack_slurm_conf_gives_each_slurmd_its_own_files():
    settings = dict(line.split("=", 1) for line in slurm.slurm_conf().splitlines()
                    if "=" in line and not line.startswith(("#", "NodeName=", "PartitionName=")))
    for key in ("SlurmdPidFile", "SlurmdLogFile", "SlurmdSpoolDir"):
        assert "%n" in settings[key], key
    # Not the one-node versions' names: a pid file left by one is never taken for a node's.
    assert not settings["SlurmdPidFile"].endswith("/slurmd.pid")
    assert slurm.slurmd_pidfile("gpu-node-02").name == "slurmd-gpu-node-02.pid"
    assert settings["SlurmdPidFile"].replace("%n", "gpu-node-02") == str(slurm.slurmd_pidfile("gpu-node-02"))


def test_localstack_gres_conf_has_one_line_and_own_devices_per_node():
    lines = slurm.gres_conf().splitlines()
    assert [line.split()[0] for line in lines] == ["NodeName=gpu-node-01", "NodeName=gpu-node-02"]
    files = [dict(word.split("=", 1) for word in line.split())["File"] for line in lines]
    assert all(f.endswith("/gpu[0-7]") for f in files)
    assert len(set(files)) == 2
    for line in lines:
        fields = dict(word.split("=", 1) for word in line.split())
        assert fields["Name"] == "gpu" and fields["Type"] == "h200"
        assert fields["File"] == f"{slurm.gres_dir(fields['NodeName'])}/gpu[0-7]"


def test_localstack_runs_one_slurmd_service_per_node():
    services = {svc.name: svc for svc in localstack.services()}
    slurmds = [name for name in services if name.startswith("slurmd-")]
    assert slurmds == ["slurmd-gpu-node-01", "slurmd-gpu-node-02"]
    assert services["slurmd-gpu-node-02"].logfile.name == "slurmd-gpu-node-02.log"
    assert len({services[name].pidfile for name in slurmds}) == 2
    assert all(services[name].comm == "slurmd" for name in slurmds)
    # `slurmd`, the one-node versions' service name, still selects them: every node's slurmd.
    assert [svc.name for svc in localstack.by_name(["slurmd"])] == slurmds


def test_localstack_finds_slurm_daemons_by_their_pid_files(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "P", common.Paths(tmp_path))
    run_dir = tmp_path / "slurm" / "run"
    run_dir.mkdir(parents=True)
    comms = {101: "slurmctld", 102: "slurmd", 103: "slurmd", 104: "slurmdbd", 105: "bash"}
    for name, pid in [("slurmctld", 101), ("slurmd", 102), ("slurmd-gpu-node-02", 103), ("slurmdbd", 104),
                      ("slurmd-gpu-node-01", 105)]:
        (run_dir / f"{name}.pid").write_text(f"{pid}\n")
    monkeypatch.setattr(slurm, "pid_alive", lambda pid: True)
    monkeypatch.setattr(slurm, "proc_comm", comms.get)
    found = {path.name: pid for path, pid in slurm.slurm_daemons().items()}
    # The one-node versions' slurmd.pid counts; slurmdbd's does not; a recycled PID (not slurmd) does not.
    assert found == {"slurmctld.pid": 101, "slurmd.pid": 102, "slurmd-gpu-node-02.pid": 103}


@pytest.fixture
def reconcile(tmp_path, monkeypatch):
    """reconcile_slurm_config() with the daemons, the stamp and the configs faked; returns what it stopped."""
    state = {"digest": "new", "changed": False, "running": {}, "stopped": []}
    monkeypatch.setattr(slurm, "SLURM_CONF_STAMP", tmp_path / "stamp")
    monkeypatch.setattr(slurm, "configure_slurm", lambda: (state["digest"], state["changed"]))
    monkeypatch.setattr(slurm, "slurm_daemons", lambda: dict(state["running"]))
    monkeypatch.setattr(slurm, "stop_pid", lambda name, pid, group=True: state["stopped"].append((name, group)))
    monkeypatch.setattr(slurm, "pid_alive", lambda pid: False)
    legacy = type("Legacy", (), {"pidfile": tmp_path / "legacy.pid", "owned_pid": lambda self: None})()
    monkeypatch.setattr(slurm, "LEGACY_SLURMD", legacy)

    def call(running=(), stamp=None, changed=False):
        state.update(changed=changed, stopped=[],
                     running={tmp_path / f"{name}.pid": i for i, name in enumerate(running, start=100)})
        if stamp is None:
            (tmp_path / "stamp").unlink(missing_ok=True)
        else:
            (tmp_path / "stamp").write_text(stamp + "\n")
        restarted = slurm.reconcile_slurm_config()
        assert (tmp_path / "stamp").read_text().strip() == "new"
        return restarted, state["stopped"]

    return call


def test_localstack_upgrade_restarts_daemons_started_on_another_config(reconcile):
    # A machine running the one-node stack: no stamp, the old slurmd.pid.
    restarted, stopped = reconcile(running=["slurmctld", "slurmd"], stamp=None, changed=True)
    assert restarted
    assert stopped == [("slurmd", False), ("slurmctld", False)]  # nodes first; never their process group
    restarted, stopped = reconcile(running=["slurmctld", "slurmd-gpu-node-01"], stamp="old")
    assert restarted and [name for name, _ in stopped] == ["slurmd-gpu-node-01", "slurmctld"]
    # Someone rewrote slurm.conf (an older checkout's `up`) although the stamp matches.
    restarted, _ = reconcile(running=["slurmctld"], stamp="new", changed=True)
    assert restarted


def test_localstack_unchanged_config_restarts_nothing(reconcile):
    assert reconcile(running=["slurmctld", "slurmd-gpu-node-01", "slurmd-gpu-node-02"], stamp="new") == (False, [])
    # Nothing running (a fresh machine, after `down`): nothing to restart; the daemons will read the new files.
    assert reconcile(running=[], stamp=None, changed=True) == (False, [])


def test_localstack_sshd_conf_is_loopback_key_only():
    conf = sshd.sshd_conf().splitlines()
    for line in ("ListenAddress 127.0.0.1", "PasswordAuthentication no", "PermitRootLogin no", "AllowUsers mlops"):
        assert line in conf


@pytest.mark.parametrize(
    "hosts",
    [
        "127.0.0.1 localhost\n",
        "",
        "127.0.0.1 localhost\n127.0.0.1 gpu-node-01 # hybridflow: the local Slurm nodes\n::1 ip6-localhost\n",
        "127.0.0.1 localhost",
    ],
    ids=["plain", "empty", "earlier-node-line", "no-final-newline"],
)
def test_localstack_node_names_resolve_to_loopback_once(hosts):
    nodes = ["gpu-node-01", "gpu-node-02"]
    written = slurm.hosts_with_nodes(hosts, nodes)
    node_lines = [line for line in written.splitlines() if "gpu-node-" in line]
    assert node_lines == ["127.0.0.1 gpu-node-01 gpu-node-02 # hybridflow: the local Slurm nodes"]
    assert slurm.hosts_with_nodes(written, nodes) == written  # idempotent
    assert [line for line in written.splitlines() if "gpu-node-" not in line] == [
        line for line in hosts.splitlines() if "gpu-node-" not in line]


@pytest.fixture
def open_umask():
    """The most permissive umask: a file's mode must come from how it is created, not from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_secret_is_0600_from_its_first_byte(tmp_path, monkeypatch, open_umask):
    # No chmod afterwards may be what makes it private: forbid every chmod that is not at creation.
    monkeypatch.setattr(os, "chmod", lambda *a, **k: pytest.fail("secret made private only after creation"))
    monkeypatch.setattr(Path, "chmod", lambda *a, **k: pytest.fail("secret made private only after creation"))
    seen = []
    value = common.secret("token", tmp_path / "secrets", make=lambda n: seen.append(n) or "s3cr3t")
    path = tmp_path / "secrets" / "token"
    assert value == "s3cr3t" and seen == [24]
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    assert common.secret("token", tmp_path / "secrets", make=lambda n: "other") == "s3cr3t"  # created once
    assert [p.name for p in (tmp_path / "secrets").iterdir()] == ["token"]  # no temporary file left


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o400])
def test_write_if_changed_creates_the_file_with_its_mode(tmp_path, monkeypatch, open_umask, mode):
    monkeypatch.setattr(common, "chown", lambda path, owner: None)
    created = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, m=0o777, **k: created.append(m) or real_open(p, flags, m, **k))
    path = tmp_path / "conf" / "airflow-env.json"
    assert common.write_if_changed(path, '{"k": 1}', mode=mode)
    assert created == [mode] and path.stat().st_mode & 0o777 == mode and path.read_text() == '{"k": 1}'
    assert not common.write_if_changed(path, '{"k": 1}', mode=mode)


def test_write_new_file_does_not_follow_a_planted_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    path = tmp_path / "secret"
    (tmp_path / f".secret.{os.getpid()}.tmp").symlink_to(target)
    with pytest.raises(OSError):
        common.write_new_file(path, "value", 0o600)
    assert target.read_text() == "untouched" and not path.exists()


def test_stopping_a_service_also_ends_the_process_group_its_child_leads():
    """Real processes: a service whose child leads a group of its own (the Triton guard's tritonserver) and has a
    child of its own (a python-backend stub). Stopping the service ends all three, even the one that ignores
    SIGTERM."""
    import subprocess
    import time

    from helpers.processes import wait_group_gone

    service = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "subprocess.Popen([sys.executable, '-c', 'import signal, subprocess, sys, time\\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(600)\"])\\n"
         "time.sleep(600)'], start_new_session=True)\n"
         "time.sleep(600)"],
        start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not common.child_groups(service.pid):
        time.sleep(0.05)
    (leader,) = common.child_groups(service.pid)
    assert os.getpgid(leader) == leader != service.pid
    common.stop_pid("test-service", service.pid)
    service.wait(10)

    assert wait_group_gone(leader) == []


@pytest.mark.parametrize(
    "answers, up, probes",
    [
        ([True], True, 1),  # answered at once: no second probe
        ([False, True], True, 2),  # missed once on a busy machine: up, not a false DOWN
        ([OSError("reset"), False, True], True, 3),  # a probe that raises is a miss, not a crash of `status`
        ([False, False, False], False, 3),  # down only when every round missed it
        ([OSError("refused")] * 3, False, 3),
    ],
)
def test_status_says_down_only_when_every_probe_missed(monkeypatch, answers, up, probes):
    monkeypatch.setattr(localstack, "PROBE_INTERVAL_S", 0)
    calls = []

    def ready():
        calls.append(1)
        answer = answers[len(calls) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    flaky = common.Service("flaky", ready, lambda: 0)
    steady = common.Service("steady", lambda: True, lambda: 0)
    assert localstack.services_up([flaky, steady]) == ({"flaky", "steady"} if up else {"steady"})
    assert len(calls) == probes
