"""The stack script's pure parts: profile placeholders and the rendered configs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def localstack():
    spec = importlib.util.spec_from_file_location("localstack", REPO / "scripts" / "localstack.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["localstack"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
def test_localstack_fill_placeholders(localstack, node, expected):
    assert localstack.fill_placeholders(node, {"ssh_port": 2222, "job_user": "mlops"}) == expected


@pytest.mark.parametrize("node", ["${missing}", "x-${missing}", "${"])
def test_localstack_unknown_placeholder_names_the_profile(localstack, node):
    with pytest.raises(RuntimeError, match="profile .*local.json"):
        localstack.fill_placeholders(node, {"ssh_port": 2222})


def test_localstack_profile_has_no_secrets_and_verifies_host_keys():
    profile = json.loads((REPO / "include/profiles/local.json").read_text())
    ssh = profile["connections"]["slurm_ssh"]
    assert ssh["extra"]["no_host_key_check"] is False
    assert ssh["extra"]["host_key"] == "${ssh_host_key}"
    for conn_id, conn in profile["connections"].items():
        assert conn.get("password", "${").startswith("${"), f"{conn_id}: password must come from generated state"


def test_localstack_slurm_conf_declares_both_partitions_and_gpus(localstack):
    conf = localstack.slurm_conf()
    lines = conf.splitlines()
    assert "GresTypes=gpu" in lines
    assert any(line.startswith("PartitionName=gpu-training ") for line in lines)
    assert any(line.startswith("PartitionName=cpu ") and "Default=YES" in line for line in lines)
    (node,) = [line for line in lines if line.startswith("NodeName=")]
    assert "Gres=gpu:h200:8" in node and "NodeAddr=127.0.0.1" in node
    assert localstack.gres_conf().endswith("/gpu[0-7]\n")


def test_localstack_sshd_conf_is_loopback_key_only(localstack):
    conf = localstack.sshd_conf().splitlines()
    for line in ("ListenAddress 127.0.0.1", "PasswordAuthentication no", "PermitRootLogin no", "AllowUsers mlops"):
        assert line in conf
