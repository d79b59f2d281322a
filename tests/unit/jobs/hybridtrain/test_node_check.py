"""The node self-check's checks, one table each, on this machine's real filesystem and resolver; nvidia-smi is
a recorded listing passed in (no GPU here: the process boundary where no real one can run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hybridtrain.node_check import NODE_CHECK_FAILED, Check, check_node, failure_line, free_space, gpus_visible
from hybridtrain.node_check import master_reachable as master

JOBS = Path(__file__).resolve().parents[4] / "jobs"
TWO_GPUS = "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n"


@pytest.mark.parametrize("expected, listing, ok, words", [
    (2, TWO_GPUS, True, "2 GPU(s) visible"),
    (4, TWO_GPUS, False, "2 GPU(s) visible, 4 allocated"),
    (1, "No devices were found\n", False, "0 GPU(s) visible, 1 allocated"),
    (0, TWO_GPUS, True, "no GPU allocated"),
])
def test_gpus_visible_must_match_the_allocation(expected, listing, ok, words):
    check = gpus_visible(expected, "/usr/bin/nvidia-smi", lambda argv: listing)
    assert (check.ok, check.name) == (ok, "gpus") and words in check.detail


def test_gpus_without_nvidia_smi_are_not_checked_and_a_failing_nvidia_smi_fails():
    assert gpus_visible(2, None, lambda argv: "").detail == "not checked: no nvidia-smi on this node"

    def broken(argv):
        raise subprocess.CalledProcessError(9, argv)

    assert not gpus_visible(2, "/usr/bin/nvidia-smi", broken).ok


def test_free_space_needs_a_writable_directory_with_room(tmp_path):
    assert free_space("scratch", tmp_path, 0.001, probe=True).ok
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert "below 1e+09 GiB" in free_space("scratch", tmp_path, 1e9, probe=True).detail
    assert not free_space("scratch", tmp_path / "missing", 0.001, probe=True).ok
    assert not free_space("checkpoint filesystem", tmp_path / "missing", 0.001, probe=False).ok


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; the suite's job user is not root")
def test_free_space_refuses_a_directory_it_cannot_write(tmp_path):
    tmp_path.chmod(0o500)
    assert not free_space("scratch", tmp_path, 0.001, probe=True).ok


@pytest.mark.parametrize("address, ok", [(None, True), ("127.0.0.1", True), ("localhost", True),
                                          ("no-such-host.invalid", False)])
def test_master_must_resolve(address, ok):
    assert master(address).ok is ok


def test_the_node_fails_on_any_failed_check_and_the_line_names_node_and_check(tmp_path):
    checks = check_node(node="gpu-node-07", gpus=0, checkpoint_dir=tmp_path, min_free_gib=0.001,
                        scratch_dir=str(tmp_path / "%n"), master="127.0.0.1", environ={"PATH": ""})
    assert [(c.name, c.ok) for c in checks] == [("gpus", True), ("checkpoint filesystem", True), ("scratch", False),
                                                ("master", True)]
    assert str(tmp_path / "gpu-node-07") in checks[2].detail  # %n became the node's name
    assert failure_line("gpu-node-07", Check("scratch", False, "/s: Permission denied")) == (
        "NODE CHECK FAILED on gpu-node-07: scratch: /s: Permission denied")


def test_the_cli_exits_79_with_the_line_the_operator_reads(tmp_path):
    env = {**os.environ, "SLURMD_NODENAME": "gpu-node-07", "PYTHONPATH": str(JOBS)}
    argv = [sys.executable, str(JOBS / "node_check.py"), "--checkpoint-dir", str(tmp_path), "--gpus-per-node", "0",
            "--min-free-gib", "0.001"]
    healthy = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert healthy.returncode == 0 and healthy.stdout.startswith("node check gpu-node-07: ok (gpus: ")
    sick = subprocess.run([*argv, "--scratch-dir", str(tmp_path / "nowhere" / "%n")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert sick.returncode == NODE_CHECK_FAILED == 79
    assert sick.stderr.startswith("NODE CHECK FAILED on gpu-node-07: scratch: ")
