"""Checkpoint manifests: written last, verified before any resume. Standard library only (and ``errors``,
``hybridjobs.atomic``).

Layout under ``<run_dir>/checkpoints/``::

    step_40/                  one DeepSpeed checkpoint (engine.save_checkpoint(..., tag="step_40"))
      mp_rank_00_model_states.pt
      zero_pp_rank_0_mp_rank_00_optim_states.pt      (ZeRO stages 1-3)
      MANIFEST.json           written last, atomically (a hidden *.tmp file, then a rename)
    step_80/ ...
    zero_to_fp32.py           DeepSpeed's recovery scripts (ZeRO stages), outside the step directories

Every rank writes its own shards (``zero_pp_rank_<r>_...``); the job waits for all of them (a barrier) before
rank 0 writes the manifest, and rank 0 requires every file any rank saw, so a shard that is late on a shared
filesystem fails the save instead of being left out.

A step directory is complete only when its ``MANIFEST.json`` exists and every file it lists is present with
the recorded size and sha256. Anything else in ``checkpoints/`` (a ``step_80`` without a manifest, a truncated
file, ``*.tmp`` leftovers, other names) is never selected for a resume. A checkpoint resumes only at the world
size that wrote it (see :func:`resume_refusal`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridjobs import atomic
from hybridjobs.layout import CHECKPOINT_MANIFEST
from hybridtrain.errors import CheckpointError

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "CheckpointCheck",
    "build_manifest",
    "checkpoint_steps",
    "checkpoints_to_prune",
    "files_under",
    "remove_checkpoint",
    "resume_key",
    "resume_refusal",
    "select_resume_checkpoint",
    "sha256_file",
    "step_dir_name",
    "verify_checkpoint",
    "write_json_atomic",
    "write_manifest",
]

MANIFEST_NAME = CHECKPOINT_MANIFEST
MANIFEST_FORMAT = "hybridtrain-checkpoint/1"
_STEP_DIR_RE = re.compile(r"step_(?P<step>0|[1-9]\d*)")
_REQUIRED_KEYS = ("format", "tag", "step", "epoch", "files", "metrics")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckpointCheck:
    """The outcome of verifying one step directory; ``reason`` says why it is not usable."""

    path: Path
    step: int | None
    ok: bool
    reason: str | None = None
    manifest: dict[str, Any] | None = None


def step_dir_name(step: int) -> str:
    """The directory (and DeepSpeed tag) of the checkpoint at ``step``: ``step_<n>``."""
    return f"step_{step}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    """Write the training job's JSON (sorted keys, no NaN) to ``path`` so that readers see the old file or the new
    one, never a partial one."""
    atomic.write_json_atomic(path, payload, sort_keys=True, allow_nan=False)


def build_manifest(
    step_dir: Path,
    *,
    step: int,
    epoch: int,
    metrics: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    required: Iterable[str] = (),
) -> dict[str, Any]:
    """Describe every file under ``step_dir`` (relative path, size, sha256), sorted by path.

    :param step: optimizer steps completed when the checkpoint was taken.
    :param epoch: full passes over the training rows completed at ``step``.
    :param metrics: the figures at this step (train loss, holdout AUC and log loss).
    :param extra: more top-level keys (the training plan, versions); they may not replace the ones above.
    :param required: relative paths that must be listed: the files every rank saw after its own save. Looked
        up by name, so a shard another node wrote is listed even while this node's directory listing (an NFS
        attribute cache) does not show it yet.
    :raises CheckpointError: a required file does not exist here.
    """
    names = {path.relative_to(step_dir).as_posix() for path in step_dir.rglob("*") if path.is_file()}
    required = {name for name in required if name != MANIFEST_NAME and not name.endswith(".tmp")}
    missing = sorted(name for name in required - names if not (step_dir / name).is_file())
    if missing:
        raise CheckpointError(
            f"checkpoint {step_dir}: {', '.join(missing)} written by another rank is not visible to rank 0; "
            "checkpoints/ must be on a filesystem every node shares (run_dir on shared storage)"
        )
    files = []
    for relative in sorted(names | required):
        if relative == MANIFEST_NAME or relative.endswith(".tmp"):
            continue
        path = step_dir / relative
        files.append({"path": relative, "size": path.stat().st_size, "sha256": sha256_file(path)})
    manifest = dict(extra or {})
    manifest.update(
        format=MANIFEST_FORMAT,
        tag=step_dir_name(step),
        step=step,
        epoch=epoch,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        files=files,
        metrics=dict(metrics),
    )
    return manifest


def write_manifest(step_dir: Path, manifest: Mapping[str, Any]) -> Path:
    """Write ``MANIFEST.json`` into ``step_dir`` atomically, after every checkpoint file is written."""
    path = step_dir / MANIFEST_NAME
    write_json_atomic(path, manifest)
    return path


def verify_checkpoint(step_dir: Path, *, check_hashes: bool = True) -> CheckpointCheck:
    """Check that ``step_dir`` holds a complete checkpoint: its manifest matches the directory name and every
    listed file is present with the recorded size and sha256. Files the manifest does not list are ignored.

    :param check_hashes: False checks presence and sizes only (no reading of the files' contents).
    """
    step_dir = Path(step_dir)
    match = _STEP_DIR_RE.fullmatch(step_dir.name)
    step = int(match.group("step")) if match else None

    def bad(reason: str, manifest: dict[str, Any] | None = None) -> CheckpointCheck:
        return CheckpointCheck(step_dir, step, False, reason, manifest)

    if step is None:
        return bad(f"{step_dir.name!r} is not a step_<n> directory")
    manifest_path = step_dir / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return bad(f"no {MANIFEST_NAME} (the save did not finish)")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return bad(f"{MANIFEST_NAME} is unreadable: {error}")
    if not isinstance(manifest, dict) or any(key not in manifest for key in _REQUIRED_KEYS):
        return bad(f"{MANIFEST_NAME} lacks one of {list(_REQUIRED_KEYS)}")
    if manifest["format"] != MANIFEST_FORMAT:
        return bad(
            f"{MANIFEST_NAME} format is {manifest['format']!r}, expected {MANIFEST_FORMAT!r}", manifest
        )
    if manifest["step"] != step or manifest["tag"] != step_dir.name:
        return bad(f"{MANIFEST_NAME} is for step {manifest['step']!r}, tag {manifest['tag']!r}", manifest)
    files = manifest["files"]
    if not isinstance(files, list) or not files:
        return bad(f"{MANIFEST_NAME} lists no files", manifest)
    root = step_dir.resolve()
    for entry in files:
        if not isinstance(entry, dict) or not {"path", "size", "sha256"} <= set(entry):
            return bad(f"{MANIFEST_NAME} has a malformed file entry: {entry!r}", manifest)
        path = (step_dir / entry["path"]).resolve()
        if not path.is_relative_to(root):
            return bad(f"{MANIFEST_NAME} lists a path outside the checkpoint: {entry['path']!r}", manifest)
        if not path.is_file():
            return bad(f"{entry['path']} is missing", manifest)
        size = path.stat().st_size
        if size != entry["size"]:
            return bad(f"{entry['path']} has {size} bytes, the manifest says {entry['size']}", manifest)
        if check_hashes and sha256_file(path) != entry["sha256"]:
            return bad(f"{entry['path']} does not match its sha256", manifest)
    return CheckpointCheck(step_dir, step, True, None, manifest)


def checkpoint_steps(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """The ``step_<n>`` directories under ``checkpoints_dir``, newest first; other names are ignored."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        match = _STEP_DIR_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group("step")), entry))
    return sorted(found, reverse=True)


def select_resume_checkpoint(checkpoints_dir: Path) -> tuple[CheckpointCheck | None, list[CheckpointCheck]]:
    """Pick the newest complete checkpoint.

    :return: the selected checkpoint's check (None when there is none) and the checks of the newer step
        directories that were skipped, each with its reason, for the caller to log.
    """
    skipped = []
    for _, path in checkpoint_steps(checkpoints_dir):
        check = verify_checkpoint(path)
        if check.ok:
            return check, skipped
        skipped.append(check)
    return None, skipped


def resume_key(
    plan: Mapping[str, Any], *, data_sha256: str, hidden_sizes: Iterable[int], dropout: float, zero_stage: int
) -> dict[str, Any]:
    """What a run must share with the run that wrote a checkpoint to resume it (see :func:`resume_refusal`).

    :param plan: the training plan's fields; ``total_steps`` is left out: another epochs or max_steps may resume it.
    """
    return {
        "plan": {k: v for k, v in plan.items() if k != "total_steps"},
        "data_sha256": data_sha256,
        "hidden_sizes": list(hidden_sizes),
        "dropout": dropout,
        "zero_stage": zero_stage,
    }


def resume_refusal(
    path: Path,
    manifest: Mapping[str, Any],
    resume_key: Mapping[str, Any],
    *,
    world_size: int,
    checkpoints_dir: Path,
) -> str | None:
    """Why this run must not resume the verified checkpoint at ``path``; None when it may.

    A different number of ranks is reported first, with its own remedy: ZeRO partitions the optimizer state
    per rank and the batch order depends on the rank count, so DeepSpeed cannot load the shards at another
    world size, and the generic "differs in plan" would not say what to change.

    :param manifest: the checkpoint's verified ``MANIFEST.json``.
    :param resume_key: what this run must share with the run that wrote the checkpoint.
    :param world_size: this run's number of ranks.
    """
    stored = _with_key_defaults(manifest.get("resume_key"))
    written_by = manifest.get("world_size")
    if written_by is None and isinstance(stored, dict) and isinstance(stored.get("plan"), dict):
        written_by = stored["plan"].get("world_size")
    if isinstance(written_by, int) and written_by != world_size:
        return (
            f"checkpoint {path} was written by {_ranks(written_by)}; this run has {world_size}: resume with "
            f"nodes x gpus_per_node = {_ranks(written_by)}, or start the run over (delete {checkpoints_dir}, or use a "
            "new run_dir). ZeRO optimizer state is partitioned per rank and the batch order depends on the rank "
            "count, so the checkpoint cannot be resumed at another world size"
        )
    if stored == resume_key:
        return None
    differing = sorted(
        key
        for key in {*resume_key, *(stored if isinstance(stored, dict) else {})}
        if not isinstance(stored, dict) or stored.get(key) != resume_key.get(key)
    )
    return (
        f"checkpoint {path} belongs to a different run (differs in {', '.join(differing)}): resuming it "
        f"would not reproduce an uninterrupted run. Use a new run_dir, or delete {checkpoints_dir} to start "
        "this run over"
    )


def _with_key_defaults(stored: Any) -> Any:
    """A stored resume key with the fields later versions added, at the value older checkpoints implied: a
    plan without ``accumulation`` took one micro-batch per step."""
    if isinstance(stored, dict) and isinstance(stored.get("plan"), dict) and "accumulation" not in stored["plan"]:
        return {**stored, "plan": {**stored["plan"], "accumulation": 1}}
    return stored


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def checkpoints_to_prune(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Step directories older than the ``keep`` newest complete checkpoints (complete or not).

    Nothing is pruned while fewer than ``keep`` complete checkpoints exist, and a directory newer than the
    oldest kept complete checkpoint is never pruned. Completeness is judged by manifest, presence and sizes
    (not checksums), so pruning after each save does not re-read every kept checkpoint.
    """
    entries = checkpoint_steps(checkpoints_dir)
    complete = 0
    for index, (_, path) in enumerate(entries):
        if verify_checkpoint(path, check_hashes=False).ok:
            complete += 1
            if complete == keep:
                return [older for _, older in entries[index + 1 :]]
    return []


def files_under(directory: Path) -> list[str]:
    """The files under ``directory`` as this process sees them, relative, in POSIX form."""
    return [path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()]


def remove_checkpoint(step_dir: Path) -> None:
    """Delete a step directory, manifest first, so that an interrupted delete never looks complete."""
    (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)
