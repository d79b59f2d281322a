"""The host key policy both Slurm hooks apply to a connection's extras before they connect."""

from __future__ import annotations

import pytest
from hybridflow.exceptions import SlurmConnectionError
from hybridflow.hooks.slurm import _port_aware_known_hosts, pinned_host_key

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGEThqtUSJp5RWkeyQedXAv1vMspuL2j6G+0wpVH7nvT"


@pytest.mark.parametrize("extra", [
    {"host_key": KEY},
    {"host_key": f"  {KEY} root@login-01\n", "known_hosts": "/etc/ssh/ssh_known_hosts"},
    {"host_key": KEY, "no_host_key_check": False, "allow_host_key_change": "false"},
])
def test_a_pinned_key_is_returned_as_type_and_data(extra):
    assert pinned_host_key("slurm_ssh", extra) == KEY


@pytest.mark.parametrize(("extra", "says"), [
    ({}, "has no 'host_key' extra"),
    ({"host_key": ""}, "has no 'host_key' extra"),
    ({"host_key": "   "}, "has no 'host_key' extra"),
    ({"host_key": "ssh-ed25519"}, "without key data"),
    ({"host_key": None, "known_hosts": "/root/.ssh/known_hosts"}, "not ~/.ssh/known_hosts"),
    ({"no_host_key_check": True}, "no_host_key_check: true"),
    ({"host_key": KEY, "no_host_key_check": "TRUE"}, "no_host_key_check: true"),
    ({"ignore_hostkey_verification": "true"}, "ignore_hostkey_verification: true"),
    ({"host_key": KEY, "allow_host_key_change": True}, "allow_host_key_change: true"),
    ({"known_hosts": "none"}, "known_hosts: none"),
    ({"host_key": KEY, "known_hosts": "None"}, "known_hosts: none"),
])
def test_a_connection_without_a_pin_or_with_the_check_off_is_refused_naming_it_and_the_fix(extra, says):
    with pytest.raises(SlurmConnectionError) as refused:
        pinned_host_key("slurm_ssh", extra)
    message = str(refused.value)
    assert says in message and "'slurm_ssh'" in message
    assert "set its 'host_key' extra to the login node's public host key" in message


def test_the_pin_is_written_for_the_connections_real_port():
    assert _port_aware_known_hosts("login", 2222, KEY) == f"[login]:2222 {KEY}\n".encode()
    assert _port_aware_known_hosts("login", 22, f"{KEY} comment") == f"login {KEY}\n".encode()
