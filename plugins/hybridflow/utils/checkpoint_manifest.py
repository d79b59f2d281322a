"""Verifying training checkpoints from the orchestrator's side, wherever they are stored.

The training job (jobs/hybridtrain/checkpoints.py) writes ``<root>/step_<n>/MANIFEST.json`` last, listing every
file with its size and sha256. Storage back ends (SSH to the cluster's filesystem, S3) only observe sizes and
hashes; these pure functions decide what is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hybridflow.layout import CHECKPOINT_MANIFEST

MANIFEST_NAME = CHECKPOINT_MANIFEST
STEP_DIR_RE = re.compile(r"^step_(0|[1-9]\d*)$")


@dataclass(frozen=True)
class CheckpointVerdict:
    name: str
    step: int
    complete: bool
    problems: tuple[str, ...] = ()
    manifest: Mapping = field(default_factory=dict)


def steps_newest_first(names: Iterable[str]) -> list[tuple[int, str]]:
    """``step_<n>`` directory names, newest first; anything else (tmp dirs, scripts) is ignored."""
    found = [(int(m.group(1)), name) for name in names if (m := STEP_DIR_RE.match(name.strip().rstrip("/")))]
    return sorted(((step, name.strip().rstrip("/")) for step, name in found), reverse=True)


def parse_manifest(text: str | None) -> tuple[dict | None, str | None]:
    """The manifest, or why it is unusable."""
    if text is None:
        return None, f"no {MANIFEST_NAME} (checkpoint incomplete or being written)"
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        return None, f"{MANIFEST_NAME} is not valid JSON ({exc})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or not files:
        return None, f"{MANIFEST_NAME} lists no files"
    for entry in files:
        if not isinstance(entry, dict) or not {"path", "size", "sha256"} <= set(entry):
            return None, f"{MANIFEST_NAME} has a malformed file entry: {entry!r}"
        if entry["path"].startswith("/") or ".." in entry["path"].split("/"):
            return None, f"{MANIFEST_NAME} lists a path outside the checkpoint: {entry['path']!r}"
    return manifest, None


def verify(name: str, step: int, manifest_text: str | None, sizes: Mapping[str, int],
           hashes: Mapping[str, str] | None) -> CheckpointVerdict:
    """
    Compare a manifest with what storage holds. ``sizes`` maps relative paths to observed sizes (missing files
    absent); ``hashes`` likewise for sha256, or None when only sizes were checked.
    """
    manifest, problem = parse_manifest(manifest_text)
    if manifest is None:
        return CheckpointVerdict(name, step, False, (problem,))
    problems = []
    if manifest.get("step") not in (None, step):
        problems.append(f"manifest says step {manifest.get('step')}, directory says {step}")
    for entry in manifest["files"]:
        path = entry["path"]
        if path not in sizes:
            problems.append(f"{path} is missing")
        elif sizes[path] != entry["size"]:
            problems.append(f"{path} has {sizes[path]} bytes, manifest says {entry['size']} (truncated?)")
        elif hashes is not None and hashes.get(path) != entry["sha256"]:
            problems.append(f"{path} does not match its sha256")
    return CheckpointVerdict(name, step, not problems, tuple(problems), manifest)


def parse_stat_sizes(stdout: str, base: str) -> dict[str, int]:
    """``stat -c '%s %n' -- <base>/<file> ...`` -> {relative path: size}."""
    sizes = {}
    prefix = base.rstrip("/") + "/"
    for line in stdout.splitlines():
        size, _, path = line.partition(" ")
        if size.isdigit() and path.startswith(prefix):
            sizes[path[len(prefix):]] = int(size)
    return sizes


def parse_sha256sum(stdout: str, base: str) -> dict[str, str]:
    """``sha256sum -- <base>/<file> ...`` -> {relative path: hex digest}."""
    hashes = {}
    prefix = base.rstrip("/") + "/"
    for line in stdout.splitlines():
        digest, _, path = line.partition("  ")
        if len(digest) == 64 and path.startswith(prefix):
            hashes[path[len(prefix):]] = digest
    return hashes
