"""Checkpoint verification and the capacity verdict, by tables."""

from __future__ import annotations

import json

import pytest
from hybridflow.utils.capacity import capacity_verdict
from hybridflow.utils.checkpoint_manifest import parse_sha256sum, parse_stat_sizes, steps_newest_first, verify
from hybridflow.utils.slurm import SinfoNode, SqueueRecord

H = "a" * 64
MANIFEST = json.dumps({"format": "hybridtrain-checkpoint/1", "tag": "step_20", "step": 20, "epoch": 1,
                       "files": [{"path": "model.pt", "size": 10, "sha256": H},
                                 {"path": "opt/o.pt", "size": 5, "sha256": "b" * 64}], "metrics": {}})


@pytest.mark.parametrize(
    "manifest, sizes, hashes, complete, problem",
    [
        (MANIFEST, {"model.pt": 10, "opt/o.pt": 5}, {"model.pt": H, "opt/o.pt": "b" * 64}, True, None),
        (MANIFEST, {"model.pt": 10, "opt/o.pt": 5}, None, True, None),  # sizes-only check
        (None, {}, None, False, "no MANIFEST.json"),
        ("{not json", {}, None, False, "not valid JSON"),
        (json.dumps({"files": []}), {}, None, False, "lists no files"),
        (MANIFEST, {"model.pt": 10}, None, False, "opt/o.pt is missing"),
        (MANIFEST, {"model.pt": 7, "opt/o.pt": 5}, None, False, "truncated"),
        (MANIFEST, {"model.pt": 10, "opt/o.pt": 5}, {"model.pt": "c" * 64, "opt/o.pt": "b" * 64}, False, "sha256"),
        (json.dumps({"step": 20, "files": [{"path": "../../etc/passwd", "size": 1, "sha256": H}]}), {}, None, False,
         "outside the checkpoint"),
        (MANIFEST.replace('"step": 20', '"step": 30'), {"model.pt": 10, "opt/o.pt": 5}, None, False, "step 30"),
    ],
    ids=["complete", "sizes-only", "no-manifest", "bad-json", "empty", "missing-file", "truncated",
         "wrong-hash", "path-escape", "step-mismatch"],
)
def test_checkpoint_verify(manifest, sizes, hashes, complete, problem):
    verdict = verify("step_20", 20, manifest, sizes, hashes)
    assert verdict.complete is complete
    if problem:
        assert any(problem in p for p in verdict.problems), verdict.problems


def test_checkpoint_steps_newest_first_ignores_other_names():
    names = ["step_5", "step_40", "step_40.tmp", "zero_to_fp32.py", "step_100/", "step_", "latest", "step_007"]
    assert steps_newest_first(names) == [(100, "step_100"), (40, "step_40"), (5, "step_5")]


def test_checkpoint_parse_remote_listings():
    base = "/c/run 1/step_20"
    stat = f"10 {base}/model.pt\n5 {base}/opt/o.pt\nstat: cannot stat '{base}/x': No such file\n"
    sums = f"{H}  {base}/model.pt\n"
    assert parse_stat_sizes(stat, base) == {"model.pt": 10, "opt/o.pt": 5}
    assert parse_sha256sum(sums, base) == {"model.pt": H}


def node(name, state="idle", total=8, used=0, available=True, flags=""):
    return SinfoNode(name=name, state=state, flags=frozenset(flags), available=available, gpus_total=total,
                     gpus_used=used)


def pending(reason):
    return SqueueRecord(job_id="1", name="x", state="PENDING", reason=reason, gres="gpu:1", gpus_per_node=1, nodes=1,
                        elapsed_seconds=0)


@pytest.mark.parametrize(
    "nodes, queue, gpus, nodes_needed, ok, fragment",
    [
        ([node("n1")], [], 1, 1, True, "8/8 GPUs free; fits on n1"),
        ([node("n1", "allocated", used=8)], [pending("Resources")], 1, 1, False, "1 pending (Resources)"),
        ([node("n1", "mixed", used=6)], [], 4, 1, False, "n1 mixed 2/8 free"),
        ([node("n1", "drained", available=False)], [], 1, 1, False, "n1 drained 0/8 free"),
        ([node("n1"), node("n2", used=8)], [], 2, 2, False, "need 2 node(s)"),
        ([node("n1"), node("n2")], [], 8, 2, True, "fits on n1, n2"),
        ([], [], 1, 1, False, "has no nodes"),
        # a CPU job (the CPU placement): nodes up is the gate; GPUs are neither asked for nor counted
        ([node("n1", total=0), node("n2", total=0)], [], 0, 2, True, "2 node(s) up, no GPU asked; fits on n1, n2"),
        ([node("n1", used=8)], [], 0, 1, True, "no GPU asked; fits on n1"),
        ([node("n1", "down", available=False)], [], 0, 1, False, "need 1 node(s) with 0 free GPU(s); have 0"),
    ],
)
def test_capacity_verdict(nodes, queue, gpus, nodes_needed, ok, fragment):
    verdict = capacity_verdict("gpu-training", nodes, queue, gpus, nodes_needed)
    assert verdict.can_run_now is ok
    assert fragment in verdict.reason
    assert verdict.impossible is (not nodes)


@pytest.mark.parametrize(
    "nodes, gpus, nodes_needed, fragment",
    [
        ([node("n1"), node("n2")], 9, 1, "its largest node is n2 with 8 GPU(s); ask for at most 8 GPU(s) per node"),
        ([node("n1"), node("n2")], 1, 3, "only 2 of its 2 node(s) have 1+ GPUs (largest: n2 with 8); ask for at most"),
        ([node("a", total=4), node("b", total=8)], 8, 2, "only 1 of its 2 node(s) have 8+ GPUs (largest: b with 8)"),
        ([node("n1", total=0)], 1, 1, "its largest node is n1 with 0 GPU(s)"),
    ],
    ids=["too-many-gpus-per-node", "too-many-nodes", "too-few-big-nodes", "cpu-only-partition"],
)
def test_capacity_refuses_at_once_what_no_node_set_can_ever_run(nodes, gpus, nodes_needed, fragment):
    verdict = capacity_verdict("gpu-training", nodes, [], gpus, nodes_needed)
    assert verdict.impossible and not verdict.can_run_now
    assert f"{nodes_needed} node(s) x {gpus} GPU(s) can never run in partition 'gpu-training'" in verdict.reason
    assert fragment in verdict.reason


def test_a_busy_or_drained_node_still_counts_toward_what_could_run_later():
    nodes = [node("n1", "allocated", used=8), node("n2", "drained", available=False)]
    verdict = capacity_verdict("gpu-training", nodes, [pending("Resources")], 8, 2)
    assert not verdict.can_run_now and not verdict.impossible
    assert "1 pending (Resources)" in verdict.reason
