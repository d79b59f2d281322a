"""Checkpoint manifests: written last, verified file by file, newest complete one selected for a resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hybridtrain.checkpoints import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    build_manifest,
    checkpoint_steps,
    checkpoints_to_prune,
    files_under,
    remove_checkpoint,
    resume_key,
    resume_refusal,
    select_resume_checkpoint,
    sha256_file,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
)
from hybridtrain.errors import CheckpointError, ExitCode

FILES = {
    "mp_rank_00_model_states.pt": b"model" * 100,
    "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"optim" * 300,
}


def make_checkpoint(root: Path, step: int, *, manifest: bool = True) -> Path:
    step_dir = root / f"step_{step}"
    step_dir.mkdir(parents=True)
    for name, content in FILES.items():
        (step_dir / name).write_bytes(content)
    if manifest:
        write_manifest(
            step_dir, build_manifest(step_dir, step=step, epoch=step // 10, metrics={"train_loss": 0.5})
        )
    return step_dir


def test_training_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    step_dir = make_checkpoint(tmp_path, 40)
    (step_dir / "nested").mkdir()
    (step_dir / "nested" / "shard.pt").write_bytes(b"x")
    (step_dir / "leftover.tmp").write_bytes(b"partial")
    manifest = build_manifest(step_dir, step=40, epoch=4, metrics={"holdout_auc": 0.8}, extra={"run_id": "r"})
    assert [entry["path"] for entry in manifest["files"]] == [
        "mp_rank_00_model_states.pt",
        "nested/shard.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    first = manifest["files"][0]
    assert first["size"] == 500
    assert first["sha256"] == sha256_file(step_dir / "mp_rank_00_model_states.pt")
    assert (manifest["format"], manifest["tag"], manifest["step"], manifest["epoch"]) == (
        MANIFEST_FORMAT,
        "step_40",
        40,
        4,
    )
    assert manifest["metrics"] == {"holdout_auc": 0.8}
    assert manifest["run_id"] == "r"


def test_training_manifest_requires_every_file_the_ranks_saw(tmp_path):
    step_dir = make_checkpoint(tmp_path, 40, manifest=False)
    manifest = build_manifest(
        step_dir,
        step=40,
        epoch=4,
        metrics={},
        required={"zero_pp_rank_0_mp_rank_00_optim_states.pt", "gone.tmp", MANIFEST_NAME},
    )
    assert len(manifest["files"]) == 2, "temporary files and the manifest itself are never required"
    with pytest.raises(CheckpointError) as raised:
        build_manifest(
            step_dir,
            step=40,
            epoch=4,
            metrics={},
            required={"zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"},
        )
    assert str(raised.value) == (
        f"checkpoint {step_dir}: zero_pp_rank_1_mp_rank_00_optim_states.pt written by another rank is not "
        "visible to rank 0; checkpoints/ must be on a filesystem every node shares (run_dir on shared storage)"
    )
    assert raised.value.exit_code == ExitCode.FAILED


def test_training_manifest_is_written_atomically(tmp_path):
    step_dir = make_checkpoint(tmp_path, 10)
    assert json.loads((step_dir / MANIFEST_NAME).read_text())["step"] == 10
    assert not list(step_dir.glob("*.tmp"))
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "x.json", {"loss": math.nan})


def _truncate(step_dir: Path) -> None:
    path = step_dir / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[:100])


def _flip_bytes(step_dir: Path) -> None:
    path = step_dir / "mp_rank_00_model_states.pt"
    path.write_bytes(b"MODEL" + path.read_bytes()[5:])


def _delete_file(step_dir: Path) -> None:
    (step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()


def _delete_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).unlink()


def _edit_manifest(**changes):
    def edit(step_dir: Path) -> None:
        manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
        manifest.update(changes)
        (step_dir / MANIFEST_NAME).write_text(json.dumps(manifest))

    return edit


def _garble_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST_NAME).write_text('{"step": 20, "files": [')


def _add_unlisted_file(step_dir: Path) -> None:
    (step_dir / "extra.bin").write_bytes(b"not in the manifest")


@pytest.mark.parametrize(
    ("damage", "ok", "reason"),
    [
        (None, True, None),
        (_add_unlisted_file, True, None),
        (_truncate, False, "mp_rank_00_model_states.pt has 100 bytes, the manifest says 500"),
        (_flip_bytes, False, "mp_rank_00_model_states.pt does not match its sha256"),
        (_delete_file, False, "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
        (_delete_manifest, False, "no MANIFEST.json (the save did not finish)"),
        (_garble_manifest, False, "MANIFEST.json is unreadable"),
        (_edit_manifest(step=30), False, "MANIFEST.json is for step 30"),
        (_edit_manifest(files=[]), False, "MANIFEST.json lists no files"),
        (_edit_manifest(format="other/2"), False, "format is 'other/2'"),
        (
            _edit_manifest(files=[{"path": "../step_10/x", "size": 1, "sha256": "0"}]),
            False,
            "outside the checkpoint",
        ),
        (_edit_manifest(files=[{"path": "x"}]), False, "malformed file entry"),
    ],
    ids=[
        "complete",
        "unlisted-extra-file",
        "truncated-file",
        "wrong-checksum",
        "missing-file",
        "missing-manifest",
        "unreadable-manifest",
        "manifest-of-other-step",
        "empty-file-list",
        "unknown-format",
        "path-escape",
        "malformed-entry",
    ],
)
def test_training_checkpoint_verification(tmp_path, damage, ok, reason):
    step_dir = make_checkpoint(tmp_path, 20)
    if damage is not None:
        damage(step_dir)
    check = verify_checkpoint(step_dir)
    assert (check.ok, check.step) == (ok, 20)
    if reason is None:
        assert check.reason is None
        assert check.manifest["step"] == 20
    else:
        assert reason in check.reason


def test_training_checkpoint_verification_without_hashes_checks_sizes_only(tmp_path):
    step_dir = make_checkpoint(tmp_path, 20)
    _flip_bytes(step_dir)
    assert verify_checkpoint(step_dir, check_hashes=False).ok
    _truncate(step_dir)
    assert not verify_checkpoint(step_dir, check_hashes=False).ok


def test_training_checkpoint_verification_rejects_other_directory_names(tmp_path):
    directory = tmp_path / "step_20.tmp"
    directory.mkdir()
    check = verify_checkpoint(directory)
    assert (check.ok, check.step) == (False, None)
    assert "is not a step_<n> directory" in check.reason


def _layout(tmp_path: Path, spec: list[tuple[str, str]]) -> Path:
    """Builds checkpoints/ from (name, kind) pairs: complete, partial, truncated, corrupt, file, dir."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    for name, kind in spec:
        if kind == "file":
            (root / name).write_text("x")
        elif kind == "dir":
            (root / name).mkdir()
            (root / name / "mp_rank_00_model_states.pt").write_bytes(b"x")
        else:
            step_dir = make_checkpoint(root, int(name.removeprefix("step_")), manifest=kind != "partial")
            if kind == "truncated":
                _truncate(step_dir)
            if kind == "corrupt":
                _flip_bytes(step_dir)
    return root


@pytest.mark.parametrize(
    ("spec", "selected", "skipped"),
    [
        ([], None, []),
        ([("step_10", "complete"), ("step_20", "complete")], 20, []),
        ([("step_9", "complete"), ("step_10", "complete"), ("step_100", "complete")], 100, []),
        ([("step_10", "complete"), ("step_20", "truncated")], 10, [20]),
        ([("step_10", "complete"), ("step_20", "corrupt"), ("step_30", "partial")], 10, [30, 20]),
        ([("step_10", "partial")], None, [10]),
        ([("step_0", "complete"), ("step_5", "partial")], 0, [5]),
        (
            [
                ("step_10", "complete"),
                ("step_20.tmp", "dir"),
                ("step_30-partial", "dir"),
                ("tmp_step_40", "dir"),
                ("step_50", "file"),
                ("step_060", "dir"),
                ("zero_to_fp32.py", "file"),
                ("latest", "file"),
            ],
            10,
            [],
        ),
    ],
    ids=[
        "empty",
        "newest",
        "numeric-order",
        "truncated-newest",
        "partial-and-corrupt",
        "only-partial",
        "step-zero",
        "tmp-dirs-and-other-names",
    ],
)
def test_training_resume_selection(tmp_path, spec, selected, skipped):
    root = _layout(tmp_path, spec)
    choice, skipped_checks = select_resume_checkpoint(root)
    assert (None if choice is None else choice.step) == selected
    assert [check.step for check in skipped_checks] == skipped
    assert all(check.reason for check in skipped_checks)


def test_training_resume_selection_without_checkpoints_dir(tmp_path):
    assert select_resume_checkpoint(tmp_path / "absent") == (None, [])
    assert checkpoint_steps(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("spec", "keep", "pruned"),
    [
        ([("step_10", "complete"), ("step_20", "complete"), ("step_30", "complete")], 2, ["step_10"]),
        ([("step_10", "complete"), ("step_20", "complete")], 2, []),
        (
            [("step_10", "complete"), ("step_20", "partial"), ("step_30", "complete")],
            1,
            ["step_20", "step_10"],
        ),
        ([("step_10", "complete"), ("step_20", "truncated"), ("step_30", "complete")], 2, []),
        ([("step_5", "partial"), ("step_10", "complete"), ("step_20", "complete")], 2, ["step_5"]),
    ],
    ids=[
        "older-than-kept",
        "nothing-to-prune",
        "partial-between",
        "truncated-does-not-count",
        "older-partial",
    ],
)
def test_training_checkpoint_pruning(tmp_path, spec, keep, pruned):
    root = _layout(tmp_path, spec)
    assert [path.name for path in checkpoints_to_prune(root, keep)] == pruned


def test_training_remove_checkpoint_deletes_the_directory(tmp_path):
    step_dir = make_checkpoint(tmp_path, 10)
    remove_checkpoint(step_dir)
    assert not step_dir.exists()
    remove_checkpoint(step_dir)


KEY = {
    "plan": {"n_train_rows": 2400, "batch_size": 32, "world_size": 2, "seed": 11, "steps_per_epoch": 37},
    "data_sha256": "abc",
    "hidden_sizes": [16],
    "dropout": 0.0,
    "zero_stage": 1,
}


def _key(plan: dict | None = None, **changes) -> dict:
    return {**KEY, "plan": {**KEY["plan"], "accumulation": 1, **(plan or {})}, **changes}


@pytest.mark.parametrize(
    ("manifest", "run_key", "world_size", "refusal"),
    [
        ({"world_size": 2, "resume_key": _key()}, _key(), 2, None),
        (
            {"world_size": 2, "resume_key": _key()},
            _key({"world_size": 1}),
            1,
            "checkpoint CK/step_40 was written by 2 ranks; this run has 1: resume with nodes x gpus_per_node = 2 "
            "ranks, or start the run over (delete CK, or use a new run_dir). ZeRO optimizer state is partitioned "
            "per rank and the batch order depends on the rank count, so the checkpoint cannot be resumed at another "
            "world size",
        ),
        (
            {"world_size": 1, "resume_key": _key({"world_size": 1}, data_sha256="old")},
            _key({"world_size": 4}),
            4,
            "checkpoint CK/step_40 was written by 1 rank; this run has 4: resume with nodes x gpus_per_node = 1 rank, "
            "or",
        ),
        (
            {"resume_key": _key({"world_size": 8})},
            _key(),
            2,
            "checkpoint CK/step_40 was written by 8 ranks; this run has 2",
        ),
        (
            {"world_size": 2, "resume_key": _key(data_sha256="other")},
            _key(),
            2,
            "checkpoint CK/step_40 belongs to a different run (differs in data_sha256): resuming it would not "
            "reproduce an uninterrupted run. Use a new run_dir, or delete CK to start this run over",
        ),
        (
            {"world_size": 2, "resume_key": _key({"accumulation": 2})},
            _key(),
            2,
            "belongs to a different run (differs in plan)",
        ),
        ({"world_size": 2, "resume_key": {**KEY}}, _key(), 2, None),
        (
            {"world_size": 2, "resume_key": {**KEY}},
            _key({"accumulation": 4}),
            2,
            "belongs to a different run (differs in plan)",
        ),
        ({"world_size": 2}, _key(), 2, "belongs to a different run (differs in data_sha256, dropout, hidden_sizes"),
        (
            {"world_size": 2, "resume_key": _key(extra="x")},
            _key(),
            2,
            "belongs to a different run (differs in extra)",
        ),
    ],
    ids=[
        "same-run",
        "two-ranks-to-one",
        "world-size-named-before-other-differences",
        "older-manifest-world-size-from-plan",
        "changed-data",
        "changed-accumulation",
        "key-before-accumulation-existed-means-1",
        "key-before-accumulation-existed-vs-4",
        "no-resume-key",
        "unknown-stored-field",
    ],
)
def test_training_resume_refusal(manifest, run_key, world_size, refusal):
    message = resume_refusal(
        Path("CK/step_40"), manifest, run_key, world_size=world_size, checkpoints_dir=Path("CK")
    )
    if refusal is None:
        assert message is None
    else:
        assert message is not None and refusal in message, message


def test_training_resume_key_leaves_the_run_length_out():
    """A run with another epochs or max_steps resumes the checkpoint; anything else that shapes the steps refuses."""
    plan = {"n_train_rows": 1294, "batch_size": 32, "world_size": 2, "seed": 11, "steps_per_epoch": 20,
            "accumulation": 2}
    key = resume_key({**plan, "total_steps": 60}, data_sha256="abc", hidden_sizes=(64, 32), dropout=0.1,
                     zero_stage=2)
    assert key == {"plan": plan, "data_sha256": "abc", "hidden_sizes": [64, 32], "dropout": 0.1, "zero_stage": 2}
    longer = resume_key({**plan, "total_steps": 600}, data_sha256="abc", hidden_sizes=[64, 32], dropout=0.1,
                        zero_stage=2)
    manifest = {"world_size": 2, "resume_key": key}
    assert resume_refusal(Path("CK/step_40"), manifest, longer, world_size=2, checkpoints_dir=Path("CK")) is None


def test_training_files_under_a_step_dir_are_relative_posix_paths(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for name in ("a.pt", "sub/b.pt", "sub/deeper/c.pt"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(files_under(tmp_path)) == ["a.pt", "sub/b.pt", "sub/deeper/c.pt"]
    assert files_under(tmp_path / "absent") == []
