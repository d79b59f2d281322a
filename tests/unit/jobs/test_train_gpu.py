"""GPU utilization sampling in the training job: numbers from nvidia-smi, or a record that there are none."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "jobs"))

from hybridtrain.gpu import (  # noqa: E402
    GpuSampler,
    nvidia_smi_command,
    parse_nvidia_smi_csv,
    read_gpu_metrics,
    summarise_gpu_metrics,
)


def test_training_nvidia_smi_command_queries_utilization_memory_power():
    assert nvidia_smi_command("nvidia-smi") == [
        "nvidia-smi",
        "--query-gpu=utilization.gpu,memory.used,power.draw",
        "--format=csv,noheader,nounits",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "87, 30512, 412.30\n",
            [{"index": 0, "utilization_pct": 87.0, "memory_used_mib": 30512.0, "power_w": 412.3}],
        ),
        (
            "0, 1, 70.5\n100, 81559, 699.9\n\n",
            [
                {"index": 0, "utilization_pct": 0.0, "memory_used_mib": 1.0, "power_w": 70.5},
                {"index": 1, "utilization_pct": 100.0, "memory_used_mib": 81559.0, "power_w": 699.9},
            ],
        ),
        (
            "12, 400, [N/A]\n",
            [{"index": 0, "utilization_pct": 12.0, "memory_used_mib": 400.0, "power_w": None}],
        ),
        (
            "[Not Supported], 400, 30\n",
            [{"index": 0, "utilization_pct": None, "memory_used_mib": 400.0, "power_w": 30.0}],
        ),
        ("", []),
    ],
    ids=["one-gpu", "two-gpus", "power-not-available", "utilization-not-supported", "no-gpus"],
)
def test_training_parse_nvidia_smi_csv(text, expected):
    assert parse_nvidia_smi_csv(text) == expected


@pytest.mark.parametrize("text", ["87, 30512\n", "abc, 1, 2\n", "nan, 1, 2\n"], ids=["short", "text", "nan"])
def test_training_parse_nvidia_smi_csv_rejects_malformed_lines(text):
    with pytest.raises(ValueError):
        parse_nvidia_smi_csv(text)


def test_training_gpu_summary_means_over_samples_and_gpus():
    records = [
        {
            "gpu_available": True,
            "host": "n1",
            "gpus": [
                {"index": 0, "utilization_pct": 80.0, "memory_used_mib": 100.0, "power_w": 300.0},
                {"index": 1, "utilization_pct": 60.0, "memory_used_mib": 300.0, "power_w": None},
            ],
        },
        {"gpu_available": True, "host": "n1", "error": "nvidia-smi failed: timeout", "gpus": []},
        {
            "gpu_available": True,
            "host": "n1",
            "gpus": [
                {"index": 0, "utilization_pct": 100.0, "memory_used_mib": 200.0, "power_w": 400.0},
            ],
        },
    ]
    assert summarise_gpu_metrics(records) == {
        "gpu_available": True,
        "samples": 2,
        "gpus": 2,
        "mean_utilization_pct": 80.0,
        "mean_memory_used_mib": 200.0,
        "mean_power_w": 350.0,
    }


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        ([{"gpu_available": False, "reason": "nvidia-smi not found"}], "nvidia-smi not found"),
        ([], "no GPU samples were recorded"),
    ],
)
def test_training_gpu_summary_without_gpus_is_null_not_zero(records, reason):
    summary = summarise_gpu_metrics(records)
    assert summary["gpu_available"] is False
    assert summary["mean_utilization_pct"] is None
    assert summary["mean_power_w"] is None
    assert summary["reason"] == reason


def test_training_read_gpu_metrics_skips_a_cut_line(tmp_path):
    path = tmp_path / "gpu_metrics.jsonl"
    path.write_text('{"gpu_available": false, "reason": "x"}\n{"gpu_avail')
    assert read_gpu_metrics(path) == [{"gpu_available": False, "reason": "x"}]
    assert read_gpu_metrics(tmp_path / "absent.jsonl") == []


def fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    """A stand-in nvidia-smi: this machine has no GPU, so the process boundary is where the test plugs in."""
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def wait_for_lines(path: Path, count: int, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_gpu_metrics(path)
        if len(records) >= count:
            return records
        time.sleep(0.02)
    raise AssertionError(f"{path} has fewer than {count} records")


def test_training_gpu_sampler_without_nvidia_smi_writes_one_record(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    path = tmp_path / "gpu_metrics.jsonl"
    sampler = GpuSampler(path, interval_s=0.01)
    sampler.start()
    sampler.join(timeout=10)
    assert not sampler.is_alive()
    (record,) = read_gpu_metrics(path)
    assert record["gpu_available"] is False
    assert record["reason"] == "nvidia-smi not found"
    assert {"ts", "host"} <= set(record)


def test_training_gpu_sampler_appends_samples_until_stopped(tmp_path):
    executable = fake_nvidia_smi(tmp_path, 'echo "$@" > "$(dirname "$0")/args"\necho "55, 1024, 250.5"\n')
    path = tmp_path / "gpu_metrics.jsonl"
    sampler = GpuSampler(path, interval_s=0.05, executable=executable)
    sampler.start()
    wait_for_lines(path, 3)
    sampler.stop()
    assert not sampler.is_alive()
    records = read_gpu_metrics(path)
    assert all(
        r["gpu_available"]
        and r["gpus"] == [{"index": 0, "utilization_pct": 55.0, "memory_used_mib": 1024.0, "power_w": 250.5}]
        for r in records
    )
    assert (tmp_path / "args").read_text().split() == nvidia_smi_command(executable)[1:]
    assert summarise_gpu_metrics(records)["mean_utilization_pct"] == 55.0


def test_training_gpu_sampler_reports_a_failing_nvidia_smi(tmp_path):
    executable = fake_nvidia_smi(
        tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate" >&2\nexit 9\n'
    )
    path = tmp_path / "gpu_metrics.jsonl"
    sampler = GpuSampler(path, interval_s=0.01, executable=executable)
    sampler.start()
    sampler.join(timeout=10)
    (record,) = read_gpu_metrics(path)
    assert record["gpu_available"] is False
    assert (
        record["reason"]
        == "nvidia-smi failed: exit 9: NVIDIA-SMI has failed because it could not communicate"
    )
    assert json.dumps(record)
    assert os.path.getsize(path) > 0
