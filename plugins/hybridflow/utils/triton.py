"""Pure builders and parsers for Triton model repositories: the rendered config.pbtxt, the version layout and
its record, the exported model's signature and smoke set, the version choices of a deploy or a rollback."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlparse

from hybridflow.exceptions import ConfigError
from hybridflow.layout import MODEL_FILE, SIGNATURE_FILE, SMOKE_FILE  # an export's files; a version holds them too
from hybridflow.paths import include_dir

if TYPE_CHECKING:
    from pathlib import Path

TEMPLATE_DIR = include_dir() / "templates" / "triton"
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MODEL_NAME_PATTERN = MODEL_NAME_RE.pattern
BACKENDS = ("python", "pytorch_libtorch")
INPUT_NAME = "INPUT__0"
OUTPUT_NAME = "OUTPUT__0"
PYTHON_BACKEND_FILE = "model.py"
CONFIG_FILE = "config.pbtxt"
# Written last into a version directory: its presence says the version is complete.
RECORD_FILE = "hybridflow.json"


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
        if not MODEL_NAME_RE.fullmatch(self.name):
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


def check_model_name(name: str, field_name: str = "model_name") -> str:
    if not isinstance(name, str) or not MODEL_NAME_RE.fullmatch(name):
        raise ConfigError(f"{field_name} {name!r}: use letters, digits, '_', '.', '-' (at most 128, not "
                          "starting with a symbol)")
    return name


@dataclass(frozen=True)
class Repository:
    """Where model directories live: a local directory or ``s3://bucket/prefix``."""

    uri: str
    scheme: str
    location: str
    prefix: str = ""

    @classmethod
    def parse(cls, uri: str) -> Repository:
        if not isinstance(uri, str) or not uri.strip():
            raise ConfigError("repository is empty; give a local directory or s3://bucket/prefix")
        uri = uri.strip()
        if uri.startswith("s3://"):
            parsed = urlparse(uri)
            if not parsed.netloc:
                raise ConfigError(f"repository {uri!r}: an S3 repository is s3://bucket/prefix; "
                                  "the bucket is missing")
            return cls(uri=uri, scheme="s3", location=parsed.netloc, prefix=parsed.path.strip("/"))
        if "://" in uri:
            raise ConfigError(f"repository {uri!r}: use a local absolute directory or s3://bucket/prefix")
        if not uri.startswith("/"):
            raise ConfigError(f"repository {uri!r}: a local repository must be an absolute path")
        return cls(uri=uri, scheme="local", location=uri.rstrip("/") or "/")


@dataclass(frozen=True)
class ExportSignature:
    """The served model's contract read from ``signature.json``."""

    n_features: int
    feature_columns: tuple[str, ...]


def parse_signature(data: Any, where: str = SIGNATURE_FILE) -> ExportSignature:
    """The exported model's signature, checked against the tensor names the Triton config declares."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    n_features = data.get("n_features")
    if not isinstance(n_features, int) or isinstance(n_features, bool) or n_features < 1:
        raise ConfigError(f"{where}: n_features is {n_features!r}; re-export the model (a positive integer)")
    columns = data.get("feature_columns") or []
    if len(columns) != n_features:
        raise ConfigError(f"{where}: feature_columns has {len(columns)} names but n_features is {n_features}")
    tensor_specs = (("inputs", INPUT_NAME, [-1, n_features]), ("outputs", OUTPUT_NAME, [-1, 1]))
    for key, expected, dtype_shape in tensor_specs:
        tensors = data.get(key)
        if not isinstance(tensors, list) or len(tensors) != 1 or not isinstance(tensors[0], Mapping):
            raise ConfigError(f"{where}: {key} must list exactly one tensor, got {tensors!r}")
        tensor = tensors[0]
        if tensor.get("name") != expected:
            raise ConfigError(f"{where}: {key}[0].name is {tensor.get('name')!r}; the Triton config serves "
                              f"{expected!r}: export with that name")
        if tensor.get("dtype", "float32") != "float32":
            raise ConfigError(f"{where}: {key}[0].dtype is {tensor.get('dtype')!r}; Triton serves float32")
        if list(tensor.get("shape", dtype_shape)) != dtype_shape:
            raise ConfigError(f"{where}: {key}[0].shape is {tensor.get('shape')!r}; expected {dtype_shape}")
    return ExportSignature(n_features=n_features, feature_columns=tuple(columns))


@dataclass(frozen=True)
class SmokeResult:
    rows: int
    max_abs_error: float
    atol: float

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.atol

    def to_dict(self) -> dict:
        """JSON-safe (XCom): no comparable output (a failed request, a wrong shape, NaN) is ``None``."""
        finite = self.max_abs_error != float("inf")
        return {"rows": self.rows, "max_abs_error": self.max_abs_error if finite else None, "atol": self.atol}


@dataclass(frozen=True)
class SmokeSet:
    """Fixed inputs and the outputs the exported file itself produced for them at export time."""

    inputs: tuple[tuple[float, ...], ...]
    outputs: tuple[tuple[float, ...], ...]
    atol: float

    def check(self, actual: Sequence[Sequence[float]]) -> SmokeResult:
        """Compare the server's outputs for ``inputs``; a shape mismatch is an infinite error."""
        rows = len(self.outputs)
        got = [list(map(float, row)) for row in actual]
        if len(got) != rows or any(len(a) != len(e) for a, e in zip(got, self.outputs, strict=False)):
            return SmokeResult(rows=rows, max_abs_error=float("inf"), atol=self.atol)
        error = max((abs(a - e) for ra, re_ in zip(got, self.outputs, strict=True)
                     for a, e in zip(ra, re_, strict=True)), default=0.0)
        if error != error:  # NaN from the server is a failure, not a pass
            error = float("inf")
        return SmokeResult(rows=rows, max_abs_error=error, atol=self.atol)


def parse_smoke(data: Any, n_features: int, where: str = SMOKE_FILE) -> SmokeSet:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, expected in (("input_name", INPUT_NAME), ("output_name", OUTPUT_NAME)):
        if data.get(key, expected) != expected:
            raise ConfigError(f"{where}: {key} is {data.get(key)!r}; the Triton config serves {expected!r}")
    atol = data.get("atol")
    if not isinstance(atol, int | float) or isinstance(atol, bool) or not 0 <= atol < 1:
        raise ConfigError(f"{where}: atol is {atol!r}; expected a number in [0, 1) (export sets 1e-5)")
    inputs, outputs = data.get("inputs"), data.get("outputs")
    if not isinstance(inputs, list) or not inputs:
        raise ConfigError(f"{where}: inputs must be a non-empty list of rows")
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        raise ConfigError(f"{where}: outputs must have one row per input row ({len(inputs)})")
    for i, row in enumerate(inputs):
        if not isinstance(row, list) or len(row) != n_features:
            found = len(row) if isinstance(row, list) else repr(row)
            raise ConfigError(f"{where}: inputs[{i}] has {found} values; the signature says "
                              f"n_features={n_features}")
    for i, row in enumerate(outputs):
        if not isinstance(row, list) or len(row) != 1:
            raise ConfigError(f"{where}: outputs[{i}] must be one probability in a list, got {row!r}")
    try:
        return SmokeSet(inputs=tuple(tuple(float(v) for v in row) for row in inputs),
                        outputs=tuple(tuple(float(v) for v in row) for row in outputs), atol=float(atol))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: a value is not a number ({exc})") from None


class VersionStatus(StrEnum):
    PUBLISHED = "published"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True)
class VersionRecord:
    """The ``hybridflow.json`` of a version directory: where the model came from and what became of it."""

    version: int
    sha256: str
    n_features: int
    source: str
    published_at: str
    status: VersionStatus = VersionStatus.PUBLISHED
    changed_at: str = ""
    reason: str = ""
    model_uri: str = ""  # the registry version it serves (models:/<name>/<N>); "" for one deployed by hand

    def with_status(self, status: VersionStatus, at: str, reason: str = "") -> VersionRecord:
        return replace(self, status=status, changed_at=at, reason=reason)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "status": self.status.value}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> VersionRecord:
        data = json.loads(text)
        return cls(**{**data, "status": VersionStatus(data["status"])})


def version_numbers(names: Iterable[str]) -> list[int]:
    """The version directories among a model directory's entries (Triton's rule: a positive integer name)."""
    return sorted(int(n) for n in names if n.isdigit() and not n.startswith("0"))


def next_version(existing: Iterable[int]) -> int:
    return max(existing, default=0) + 1


def find_published(records: Mapping[int, VersionRecord], sha256: str) -> int | None:
    """The version already holding this exact model file: a rerun of the same deploy reuses it."""
    matches = [v for v, r in records.items() if r.sha256 == sha256]
    return max(matches) if matches else None


def serving_version(ready: Iterable[int], records: Mapping[int, VersionRecord]) -> int | None:
    """Of the versions the server has READY, the one that serves: the newest promoted one, else the newest."""
    ready = sorted(set(ready))
    promoted = [v for v in ready if v in records and records[v].status is VersionStatus.PROMOTED]
    return (promoted or ready or [None])[-1]


def rollback_target(current: int | None, records: Mapping[int, VersionRecord]) -> int | None:
    """The version an on-call rollback restores: the newest version promoted before ``current``."""
    candidates = [v for v, r in records.items() if r.status is VersionStatus.PROMOTED
                  and (current is None or v < current)]
    return max(candidates, default=None)


def loaded_versions(previous: int | None, new: int) -> tuple[int, ...]:
    """The version policy while a new version is proven: the previous one keeps serving beside it."""
    return tuple(sorted({new} | ({previous} if previous is not None else set())))


def model_status_url(base_url: str, name: str, version: int | str | None = None) -> str:
    """The server's metadata page of a model (version): ``<base>/v2/models/<name>[/versions/<v>]``."""
    url = f"{base_url.rstrip('/')}/v2/models/{quote(name, safe='')}"
    return f"{url}/versions/{version}" if version not in (None, "") else url


@dataclass(frozen=True)
class ExportBundle:
    """An export directory of the training job, read and checked: what a new version is published from."""

    directory: Path
    sha256: str
    signature: ExportSignature
    smoke: SmokeSet

    def version_files(self) -> dict[str, Path | bytes]:
        """The files of a version directory; model.py lets CPU servers run the same model.pt as GPU ones."""
        files: dict[str, Path | bytes] = {name: self.directory / name
                                          for name in (MODEL_FILE, SIGNATURE_FILE, SMOKE_FILE)}
        files[PYTHON_BACKEND_FILE] = python_backend_source().encode()
        return files


def read_export(directory: Path) -> ExportBundle:
    """``model.pt``, ``signature.json`` and ``smoke.json`` of an export, parsed; errors name the file."""
    import hashlib

    if not directory.is_dir():
        raise ConfigError(f"export_dir {directory}: not a directory; give the export/ folder the training "
                          "job wrote")
    missing = [name for name in (MODEL_FILE, SIGNATURE_FILE, SMOKE_FILE) if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"export_dir {directory}: {', '.join(missing)} missing; re-run the export step")
    documents = {}
    for name in (SIGNATURE_FILE, SMOKE_FILE):
        try:
            documents[name] = json.loads((directory / name).read_text())
        except ValueError as exc:
            raise ConfigError(f"{directory / name}: not valid JSON ({exc}); re-run the export step") from None
    signature = parse_signature(documents[SIGNATURE_FILE], str(directory / SIGNATURE_FILE))
    smoke = parse_smoke(documents[SMOKE_FILE], signature.n_features, str(directory / SMOKE_FILE))
    digest = hashlib.sha256()
    with open(directory / MODEL_FILE, "rb") as model:
        for chunk in iter(lambda: model.read(1 << 20), b""):
            digest.update(chunk)
    return ExportBundle(directory=directory, sha256=digest.hexdigest(), signature=signature, smoke=smoke)


def versions_of(index: Sequence[Mapping[str, Any]], name: str) -> dict[int, dict]:
    """One model's versions in a repository index (HTTP list or gRPC JSON): state and the server's reason."""
    versions = {}
    for entry in index:
        if entry.get("name") == name and str(entry.get("version", "")).isdigit():
            versions[int(entry["version"])] = {"state": entry.get("state", ""), "reason": entry.get("reason", "")}
    return versions
