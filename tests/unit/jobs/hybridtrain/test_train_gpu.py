"""GPU utilization sampling in the training job: each rank's own GPUs from nvidia-smi, or a record that there
are none."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from hybridtrain.gpu import (
    GpuSampler,
    bound_gpu_ids,
    gpu_metrics_file,
    nvidia_smi_command,
    parse_nvidia_smi_csv,
    read_gpu_metrics,
    read_run_gpu_metrics,
    summarise_gpu_metrics,
)

QUERY = "--query-gpu=index,uuid,utilization.gpu,memory.used,power.draw"


@pytest.mark.parametrize(
    ("gpu_ids", "command"),
    [
        (None, ["nvidia-smi", QUERY, "--format=csv,noheader,nounits"]),
        (("3",), ["nvidia-smi", "-i", "3", QUERY, "--format=csv,noheader,nounits"]),
        (("0", "2"), ["nvidia-smi", "-i", "0,2", QUERY, "--format=csv,noheader,nounits"]),
    ],
    ids=["every-gpu", "one-bound-gpu", "two-bound-gpus"],
)
def test_training_nvidia_smi_command_queries_only_the_bound_gpus(gpu_ids, command):
    assert nvidia_smi_command("nvidia-smi", gpu_ids) == command


@pytest.mark.parametrize(
    ("environ", "ids"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2", "SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ("2",)),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, ("0", "1")),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f1c2d3e-aaaa", "SLURM_STEP_GPUS": "5"}, ("5",)),
        ({"CUDA_VISIBLE_DEVICES": "MIG-1a2b", "SLURM_JOB_GPUS": "1,4"}, ("1", "4")),
        ({"SLURM_STEP_GPUS": "6,7", "SLURM_JOB_GPUS": "4,5,6,7"}, ("6", "7")),
        ({"SLURM_JOB_GPUS": "0"}, ("0",)),
        ({"CUDA_VISIBLE_DEVICES": "", "SLURM_JOB_GPUS": "0"}, ()),
        ({"CUDA_VISIBLE_DEVICES": "0, 1"}, ("0", "1")),
        ({}, None),
    ],
    ids=[
        "cuda-visible-devices-wins",
        "two-visible",
        "uuid-falls-to-step-gpus",
        "mig-falls-to-job-gpus",
        "step-gpus",
        "job-gpus",
        "empty-means-none",  # the CPU placement's jobs: CUDA shows no GPU, so none is theirs to sample
        "spaces",
        "nothing-bound-means-all",
    ],
)
def test_training_bound_gpu_ids(environ, ids):
    assert bound_gpu_ids(environ) == ids


UUID0, UUID1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f"3, {UUID0}, 87, 30512, 412.30\n",
            [{"index": 3, "uuid": UUID0, "utilization_pct": 87.0, "memory_used_mib": 30512.0, "power_w": 412.3}],
        ),
        (
            f"0, {UUID0}, 0, 1, 70.5\n1, {UUID1}, 100, 81559, 699.9\n\n",
            [
                {"index": 0, "uuid": UUID0, "utilization_pct": 0.0, "memory_used_mib": 1.0, "power_w": 70.5},
                {"index": 1, "uuid": UUID1, "utilization_pct": 100.0, "memory_used_mib": 81559.0, "power_w": 699.9},
            ],
        ),
        (
            f"0, {UUID0}, 12, 400, [N/A]\n",
            [{"index": 0, "uuid": UUID0, "utilization_pct": 12.0, "memory_used_mib": 400.0, "power_w": None}],
        ),
        (
            f"0, {UUID0}, [Not Supported], 400, 30\n",
            [{"index": 0, "uuid": UUID0, "utilization_pct": None, "memory_used_mib": 400.0, "power_w": 30.0}],
        ),
        ("", []),
    ],
    ids=["real-index-kept", "two-gpus", "power-not-available", "utilization-not-supported", "no-gpus"],
)
def test_training_parse_nvidia_smi_csv(text, expected):
    assert parse_nvidia_smi_csv(text) == expected


@pytest.mark.parametrize(
    "text",
    [f"0, {UUID0}, 87, 30512\n", f"0, {UUID0}, abc, 1, 2\n", f"0, {UUID0}, nan, 1, 2\n", f"x, {UUID0}, 1, 1, 2\n"],
    ids=["short", "text", "nan", "index-not-a-number"],
)
def test_training_parse_nvidia_smi_csv_rejects_malformed_lines(text):
    with pytest.raises(ValueError):
        parse_nvidia_smi_csv(text)


def _gpu(index: int, uuid: str, util: float | None, memory: float = 100.0, power: float | None = 300.0) -> dict:
    return {"index": index, "uuid": uuid, "utilization_pct": util, "memory_used_mib": memory, "power_w": power}


def test_training_gpu_summary_means_over_samples_and_gpus():
    records = [
        {
            "gpu_available": True,
            "host": "n1",
            "rank": 0,
            "gpus": [_gpu(0, UUID0, 80.0, 100.0, 300.0), _gpu(1, UUID1, 60.0, 300.0, None)],
        },
        {"gpu_available": True, "host": "n1", "rank": 0, "error": "nvidia-smi failed: timeout", "gpus": []},
        {"gpu_available": True, "host": "n1", "rank": 0, "gpus": [_gpu(0, UUID0, 100.0, 200.0, 400.0)]},
    ]
    assert summarise_gpu_metrics(records) == {
        "gpu_available": True,
        "samples": 2,
        "gpus": 2,
        "mean_utilization_pct": 80.0,
        "mean_memory_used_mib": 200.0,
        "mean_power_w": 350.0,
        "per_gpu": [
            {"host": "n1", "index": 0, "uuid": UUID0, "ranks": [0], "samples": 2, "mean_utilization_pct": 90.0},
            {"host": "n1", "index": 1, "uuid": UUID1, "ranks": [0], "samples": 1, "mean_utilization_pct": 60.0},
        ],
    }


@pytest.mark.parametrize(
    ("records", "per_gpu", "mean"),
    [
        (
            [
                {"gpu_available": True, "host": "a", "rank": 0, "gpus": [_gpu(0, UUID0, 90.0)]},
                {"gpu_available": True, "host": "b", "rank": 1, "gpus": [_gpu(0, UUID0, 30.0)]},
            ],
            [("a", 0, [0], 90.0), ("b", 0, [1], 30.0)],
            60.0,
        ),
        (
            [
                {"gpu_available": True, "host": "a", "rank": 0, "gpus": [_gpu(0, UUID0, 90.0)]},
                {"gpu_available": True, "host": "a", "rank": 1, "gpus": [_gpu(0, UUID1, 10.0)]},
            ],
            [("a", 0, [0], 90.0), ("a", 0, [1], 10.0)],
            50.0,
        ),
        (
            [
                {"gpu_available": True, "host": "a", "rank": 0, "gpus": [_gpu(0, UUID0, 40.0), _gpu(1, UUID1, 0.0)]},
                {"gpu_available": True, "host": "a", "rank": 1, "gpus": [_gpu(0, UUID0, 60.0), _gpu(1, UUID1, 20.0)]},
            ],
            [("a", 0, [0, 1], 50.0), ("a", 1, [0, 1], 10.0)],
            30.0,
        ),
        (
            [
                {"gpu_available": True, "host": "a", "gpus": [{"index": 2, "utilization_pct": 70.0}]},
                {"gpu_available": False, "host": "b", "rank": 1, "reason": "nvidia-smi not found"},
            ],
            [("a", 2, [], 70.0)],
            70.0,
        ),
    ],
    ids=[
        "same-index-on-two-hosts",
        "cgroups-renumber-two-gpus-to-index-0",
        "unbound-ranks-see-the-same-gpus",
        "legacy-line-without-uuid-or-rank",
    ],
)
def test_training_gpu_summary_per_gpu(records, per_gpu, mean):
    summary = summarise_gpu_metrics(records)
    assert [
        (gpu["host"], gpu["index"], gpu["ranks"], gpu["mean_utilization_pct"]) for gpu in summary["per_gpu"]
    ] == per_gpu
    assert summary["gpus"] == len(per_gpu)
    assert summary["mean_utilization_pct"] == mean


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        ([{"gpu_available": False, "reason": "nvidia-smi not found"}], "nvidia-smi not found"),
        (
            [
                {"gpu_available": False, "rank": 0, "reason": "nvidia-smi not found"},
                {"gpu_available": False, "rank": 1, "reason": "nvidia-smi not found"},
            ],
            "nvidia-smi not found",
        ),
        ([], "no GPU samples were recorded"),
    ],
    ids=["one-rank", "every-rank-without-nvidia-smi", "no-records"],
)
def test_training_gpu_summary_without_gpus_is_null_not_zero(records, reason):
    summary = summarise_gpu_metrics(records)
    assert summary["gpu_available"] is False
    assert summary["mean_utilization_pct"] is None
    assert summary["mean_power_w"] is None
    assert summary["per_gpu"] == [] and summary["gpus"] == 0
    assert summary["reason"] == reason


def test_training_read_gpu_metrics_skips_a_cut_line(tmp_path):
    path = tmp_path / "gpu_metrics.jsonl"
    path.write_text('{"gpu_available": false, "reason": "x"}\n{"gpu_avail')
    assert read_gpu_metrics(path) == [{"gpu_available": False, "reason": "x"}]
    assert read_gpu_metrics(tmp_path / "absent.jsonl") == []


def test_training_read_run_gpu_metrics_merges_every_rank_in_time_order(tmp_path):
    (tmp_path / "gpu_metrics.jsonl").write_text('{"ts": "2026-01-01T00:00:01+00:00", "legacy": true}\n')
    gpu_metrics_file(tmp_path, 0).write_text(
        '{"ts": "2026-01-01T00:00:02+00:00", "rank": 0}\n{"ts": "2026-01-01T00:00:04+00:00", "rank": 0}\n'
    )
    gpu_metrics_file(tmp_path, 1).write_text('{"ts": "2026-01-01T00:00:03+00:00", "rank": 1}\n{"ts": "2026-')
    assert gpu_metrics_file(tmp_path, 1).name == "gpu_metrics.rank1.jsonl"
    assert [record.get("rank", "legacy") for record in read_run_gpu_metrics(tmp_path)] == ["legacy", 0, 1, 0]
    assert read_run_gpu_metrics(tmp_path / "absent") == []


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


def test_training_gpu_sampler_of_a_process_without_gpus_queries_none(tmp_path):
    """A rank placed on the CPU partition (CUDA_VISIBLE_DEVICES empty) never samples the node's GPUs: their work
    is other jobs'."""
    executable = fake_nvidia_smi(tmp_path, f'touch "$(dirname "$0")/called"\necho "0, {UUID0}, 99, 1024, 250.5"\n')
    path = tmp_path / "gpu_metrics.jsonl"
    sampler = GpuSampler(path, interval_s=0.01, executable=executable, rank=0, gpu_ids=())
    sampler.start()
    sampler.join(timeout=10)
    (record,) = read_gpu_metrics(path)
    assert record["gpu_available"] is False and "no GPU bound" in record["reason"]
    assert not (tmp_path / "called").exists()
    assert summarise_gpu_metrics([record])["mean_utilization_pct"] is None


def test_training_gpu_sampler_appends_samples_until_stopped(tmp_path):
    executable = fake_nvidia_smi(tmp_path, f'echo "$@" > "$(dirname "$0")/args"\necho "3, {UUID0}, 55, 1024, 250.5"\n')
    path = gpu_metrics_file(tmp_path, 1)
    sampler = GpuSampler(path, interval_s=0.05, executable=executable, rank=1, gpu_ids=("3",))
    sampler.start()
    wait_for_lines(path, 3)
    sampler.stop()
    assert not sampler.is_alive()
    records = read_gpu_metrics(path)
    assert all(
        r["gpu_available"]
        and (r["rank"], r["gpu_ids"]) == (1, ["3"])
        and r["gpus"] == [_gpu(3, UUID0, 55.0, 1024.0, 250.5)]
        for r in records
    )
    assert (tmp_path / "args").read_text().split() == nvidia_smi_command(executable, ("3",))[1:]
    summary = summarise_gpu_metrics(records)
    assert summary["mean_utilization_pct"] == 55.0
    assert summary["per_gpu"][0] | {"host": None} == {
        "host": None,
        "index": 3,
        "uuid": UUID0,
        "ranks": [1],
        "samples": len(records),
        "mean_utilization_pct": 55.0,
    }


def test_training_gpu_samplers_of_several_ranks_append_whole_lines_to_one_file(tmp_path):
    """O_APPEND, one write per line: even samplers sharing a file never mix lines (the job uses one file per
    rank, for filesystems where O_APPEND is not atomic across nodes)."""
    executable = fake_nvidia_smi(tmp_path, f'echo "0, {UUID0}, 1, 2, 3"\n')
    path = tmp_path / "shared.jsonl"
    samplers = [GpuSampler(path, interval_s=0.001, executable=executable, rank=rank) for rank in range(4)]
    for sampler in samplers:
        sampler.start()
    wait_for_lines(path, 40)
    for sampler in samplers:
        sampler.stop()
    lines = path.read_text().splitlines()
    assert len(read_gpu_metrics(path)) == len(lines), "every line parses"
    assert {json.loads(line)["rank"] for line in lines} == {0, 1, 2, 3}


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
