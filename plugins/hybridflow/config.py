"""Typed pipeline configuration from include/config/pipeline.yaml, validated when it is loaded.

Every error names the file, the key, what was found and what is expected, so a mistake fails at parse time
rather than in the middle of a run.
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, get_type_hints

from hybridflow.exceptions import ConfigError
from hybridflow.paths import include_dir

ENV_REF = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?::-(?P<default>[^}]*))?\}")


@dataclass(frozen=True)
class ClusterConfig:
    ssh_conn_id: str
    partition: str
    python: str
    jobs_dir: str
    max_requeues: int = 3
    poll_interval_s: float = 10.0


@dataclass(frozen=True)
class StorageConfig:
    root: str


@dataclass(frozen=True)
class PreflightConfig:
    schedule: str
    max_allreduce_share: float = 0.2
    max_age_days: int = 8
    procs: int = 2
    gpus_per_node: int = 1
    time_limit_min: int = 15

    def validate(self, where: str) -> None:
        if not 0 < self.max_allreduce_share < 1:
            raise ConfigError(f"{where}.max_allreduce_share: {self.max_allreduce_share} is not between 0 and 1")
        if self.procs < 2:
            raise ConfigError(f"{where}.procs: {self.procs}; an all-reduce needs at least 2 processes")


@dataclass(frozen=True)
class PipelineConfig:
    cluster: ClusterConfig
    storage: StorageConfig
    preflight: PreflightConfig


def expand_env(value: str, where: str) -> str:
    def replace(match: re.Match) -> str:
        name, default = match.group("name"), match.group("default")
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{where}: environment variable {name} is not set and has no default")
        return default

    return ENV_REF.sub(replace, value)


def build(cls: type, data: Any, where: str):
    """A dataclass from a mapping: unknown keys, missing keys and wrong types are errors naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    values = {}
    for f in fields(cls):
        key = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key}: missing (expected {getattr(hints[f.name], '__name__', hints[f.name])})")
            continue
        expected, value = hints[f.name], data[f.name]
        if isinstance(expected, type) and expected.__module__ == __name__:
            values[f.name] = build(expected, value, key)
            continue
        if isinstance(value, str):
            value = expand_env(value, key)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
        values[f.name] = value
    obj = cls(**values)
    if hasattr(obj, "validate"):
        obj.validate(where)
    return obj


def load_pipeline_config(path: Path | None = None) -> PipelineConfig:
    import yaml

    path = path or include_dir() / "config" / "pipeline.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the pipeline config: {exc}") from exc
    try:
        return build(PipelineConfig, data, "pipeline")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


@lru_cache(maxsize=1)
def pipeline_config() -> PipelineConfig:
    """The configuration, loaded once per process (DAG files call this at parse time)."""
    return load_pipeline_config()
