"""Pure builders for Triton model repositories: the rendered config.pbtxt and the version directory layout."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.exceptions import ConfigError
from hybridflow.paths import include_dir

TEMPLATE_DIR = include_dir() / "templates" / "triton"
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
BACKENDS = ("python", "pytorch_libtorch")


@dataclass(frozen=True)
class ModelConfigSpec:
    """What a served model's config.pbtxt says. ``python`` serves on CPU; ``pytorch_libtorch`` on GPU."""

    name: str
    n_features: int
    backend: str = "python"
    max_batch_size: int = 256
    instance_count: int = 1
    max_queue_delay_us: int | None = 100
    torch_threads: int = 1
    versions: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not MODEL_NAME_RE.match(self.name):
            raise ConfigError(f"name {self.name!r}: use letters, digits, '_', '.', '-' (at most 128)")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        for key in ("n_features", "max_batch_size", "instance_count", "torch_threads"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.max_queue_delay_us is not None and self.max_queue_delay_us < 0:
            raise ConfigError(f"max_queue_delay_us must be >= 0 or None, got {self.max_queue_delay_us!r}")
        if any(not isinstance(v, int) or v < 1 for v in self.versions):
            raise ConfigError(f"versions must be positive integers, got {self.versions!r}")


def render_model_config(spec: ModelConfigSpec) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    return env.get_template("config.pbtxt.j2").render(spec=spec)


def python_backend_source() -> str:
    """The python-backend model.py that CPU servers use to run a version's model.pt."""
    return (TEMPLATE_DIR / "model.py").read_text()
