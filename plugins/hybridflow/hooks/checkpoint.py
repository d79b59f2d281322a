"""Where checkpoints live (the cluster's filesystem over SSH, or S3) and which of them are complete."""

from __future__ import annotations

import logging
import posixpath
from typing import Protocol

from hybridflow.hooks.slurm import SlurmHook
from hybridflow.hooks.storage import StorageHook, split_s3_uri
from hybridflow.utils.checkpoint_manifest import (
    MANIFEST_NAME,
    CheckpointVerdict,
    parse_manifest,
    parse_sha256sum,
    parse_stat_sizes,
    steps_newest_first,
    verify,
)


class CheckpointStore(Protocol):
    def step_dirs(self) -> list[str]: ...
    def manifest_text(self, name: str) -> str | None: ...
    def observe(self, name: str, paths: list[str], with_hashes: bool) -> tuple[dict, dict | None]: ...
    def close(self) -> None: ...


class SshCheckpointStore:
    """Checkpoints on the cluster's filesystem, read over SSH with the job user's rights."""

    def __init__(self, root: str, hook: SlurmHook):
        self.root, self.hook = root.rstrip("/"), hook

    def step_dirs(self) -> list[str]:
        listing = self.hook.run(["ls", "-1", "--", self.root])
        return listing.stdout.split() if listing.returncode == 0 else []

    def manifest_text(self, name: str) -> str | None:
        return self.hook.read_text(posixpath.join(self.root, name, MANIFEST_NAME))

    def observe(self, name: str, paths: list[str], with_hashes: bool) -> tuple[dict, dict | None]:
        base = posixpath.join(self.root, name)
        files = [posixpath.join(base, p) for p in paths]
        sizes = parse_stat_sizes(self.hook.run(["stat", "-c", "%s %n", "--", *files]).stdout, base)
        hashes = parse_sha256sum(self.hook.run(["sha256sum", "--", *files]).stdout, base) if with_hashes else None
        return sizes, hashes

    def close(self) -> None:
        self.hook.close()


class S3CheckpointStore:
    """Checkpoints uploaded to S3 under ``s3://bucket/prefix/step_<n>/``."""

    def __init__(self, root: str, hook: StorageHook):
        self.bucket, self.prefix = split_s3_uri(root)
        self.prefix = self.prefix.rstrip("/")
        self.hook = hook

    def step_dirs(self) -> list[str]:
        return self.hook.list_prefixes(self.bucket, self.prefix)

    def manifest_text(self, name: str) -> str | None:
        return self.hook.read_text(self.bucket, f"{self.prefix}/{name}/{MANIFEST_NAME}")

    def observe(self, name: str, paths: list[str], with_hashes: bool) -> tuple[dict, dict | None]:
        base = f"{self.prefix}/{name}/"
        sizes = {key[len(base):]: size for key, size in self.hook.list_keys(self.bucket, base)}
        hashes = {p: self.hook.sha256(self.bucket, base + p) for p in paths if p in sizes} if with_hashes else None
        return sizes, hashes

    def close(self) -> None:
        pass  # boto3 pools its connections per client


def open_store(root: str, ssh_conn_id: str = "slurm_ssh", storage_conn_id: str = "storage_s3") -> CheckpointStore:
    if root.startswith("s3://"):
        return S3CheckpointStore(root, StorageHook(storage_conn_id))
    return SshCheckpointStore(root, SlurmHook(ssh_conn_id))


def newest_complete(store: CheckpointStore, min_step: int = 0, with_hashes: bool = True
                    ) -> tuple[CheckpointVerdict | None, list[CheckpointVerdict]]:
    """The newest checkpoint at or after ``min_step`` whose manifest verifies, and the newer ones rejected."""
    rejected = []
    for step, name in steps_newest_first(store.step_dirs()):
        if step < min_step:
            break
        text = store.manifest_text(name)
        manifest, _ = parse_manifest(text)
        paths = [entry["path"] for entry in manifest["files"]] if manifest else []
        sizes, hashes = store.observe(name, paths, with_hashes) if paths else ({}, None)
        verdict = verify(name, step, text, sizes, hashes)
        if verdict.complete:
            return verdict, rejected
        rejected.append(verdict)
    return None, rejected


def ready_checkpoint(store: CheckpointStore, root: str, min_step: int, with_hashes: bool,
                     log: logging.Logger) -> dict | None:
    """The checkpoint gate's answer, one rule for the sensor and its trigger: the newest complete checkpoint at or
    after ``min_step`` as ``{"name", "step", "path", "metrics"}``, or None; newer ones that fail are logged."""
    verdict, rejected = newest_complete(store, min_step, with_hashes)
    for bad in rejected:
        log.warning("skipping %s/%s: %s", root, bad.name, "; ".join(bad.problems))
    if verdict is None:
        return None
    return {"name": verdict.name, "step": verdict.step, "path": f"{root.rstrip('/')}/{verdict.name}",
            "metrics": dict(verdict.manifest.get("metrics", {}))}
