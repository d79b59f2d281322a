"""The run config that the Airflow operator writes for ``jobs/train.py``: parsed, validated and typed.

Every problem is reported at once, each naming its field (``batch_size: must be an integer >= 1, got
0``), so a bad config fails in seconds with one message instead of after DeepSpeed has started. Relative paths
are read from the directory of the run config file. An optional field given as null takes its default. Keys
starting with ``_`` are comments; any other unknown key is an error, so a misspelt option never silently falls
back to its default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

from hybridjobs.layout import CHECKPOINTS_DIR, EXPORT_DIR
from hybridtrain.errors import ConfigError
from hybridtrain.tracking import TrackingConfig, parse_tracking

__all__ = [
    "DEFAULT_MODEL_PRESETS_PATH",
    "DEEPSPEED_DEFAULT_CLIPPING",
    "ModelSpec",
    "RunConfig",
    "dates_in_range",
    "PRECISIONS",
    "deepspeed_settings_for_run",
    "settings_for_device",
    "load_model_presets",
    "load_run_config",
    "parse_run_config",
]

DEFAULT_MODEL_PRESETS_PATH = Path(__file__).resolve().parents[2] / "include" / "config" / "model_presets.json"

_DS_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
_MAX_SEED = 2**32 - 1
_KNOWN_KEYS = frozenset(
    {
        "run_id",
        "labels",
        "features_root",
        "ds",
        "ds_range",
        "run_dir",
        "model",
        "model_presets_path",
        "epochs",
        "max_steps",
        "batch_size",
        "learning_rate",
        "checkpoint_every_steps",
        "keep_last_checkpoints",
        "seed",
        "zero_stage",
        "deepspeed_config",
        "holdout_fraction",
        "log_every_steps",
        "progress_every_s",
        "gpu_sample_every_s",
        "heartbeat_every_s",
        "torch_threads",
        "collective_timeout_s",
        "allreduce_sample_every_steps",
        "gradient_accumulation_steps",
        "precision",
        "tracking",
    }
)
# auto: bf16 autocast on a GPU that supports it, float32 elsewhere; bf16: autocast on any device (CPUs too).
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class ModelSpec:
    """The network: hidden layer widths and dropout; ``preset`` names the preset they came from, if any."""

    hidden_sizes: tuple[int, ...]
    dropout: float
    preset: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A validated run config. See ``jobs/train.py`` for the JSON format and an example."""

    config_path: Path
    features_root: str
    ds: tuple[str, ...]
    run_dir: Path
    model: ModelSpec
    epochs: int | None
    max_steps: int | None
    batch_size: int
    learning_rate: float
    checkpoint_every_steps: int
    seed: int
    zero_stage: int
    deepspeed_config: Path
    deepspeed_settings: dict[str, Any]
    keep_last_checkpoints: int | None = None
    holdout_fraction: float = 0.2
    log_every_steps: int = 10
    progress_every_s: float = 5.0
    gpu_sample_every_s: float = 5.0
    heartbeat_every_s: float = 5.0
    torch_threads: int | None = None
    collective_timeout_s: float = 300.0
    allreduce_sample_every_steps: int = 25
    gradient_accumulation_steps: int = 1
    precision: str = "auto"
    run_id: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    tracking: TrackingConfig | None = None

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    @property
    def export_dir(self) -> Path:
        return self.run_dir / EXPORT_DIR


def dates_in_range(start: str, end: str) -> tuple[str, ...]:
    """Every ``YYYY-MM-DD`` from ``start`` to ``end``, both included."""
    first, last = date.fromisoformat(start), date.fromisoformat(end)
    return tuple((first + timedelta(days=offset)).isoformat() for offset in range((last - first).days + 1))


def deepspeed_settings_for_run(
    settings: Mapping[str, Any],
    *,
    batch_size: int,
    world_size: int,
    learning_rate: float,
    zero_stage: int,
    gradient_accumulation_steps: int = 1,
) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config for this run: the file's settings with the run config's batch size, accumulation,
    learning rate and ZeRO stage. ``batch_size`` is the micro-batch of one rank; DeepSpeed steps the optimizer
    every ``gradient_accumulation_steps`` micro-batches, so its global batch is micro-batch x accumulation x
    ranks, the rows one step of the training plan takes (the step count stays that of the plan).

    :return: the config, and one note per value of the file that the run config replaced.
    """
    result = json.loads(json.dumps(settings))
    notes = []

    def assign(container: dict[str, Any], key: str, value: Any, label: str) -> None:
        if key in container and container[key] != value:
            notes.append(f"{label}: {container[key]!r} in the DeepSpeed config replaced by {value!r}")
        container[key] = value

    assign(result, "train_micro_batch_size_per_gpu", batch_size, "train_micro_batch_size_per_gpu")
    assign(result, "gradient_accumulation_steps", gradient_accumulation_steps, "gradient_accumulation_steps")
    assign(
        result, "train_batch_size", batch_size * gradient_accumulation_steps * world_size, "train_batch_size"
    )
    zero = result.setdefault("zero_optimization", {})
    assign(zero, "stage", zero_stage, "zero_optimization.stage")
    if isinstance(result.get("optimizer"), dict):
        params = result["optimizer"].setdefault("params", {})
        assign(params, "lr", learning_rate, "optimizer.params.lr")
    return result, notes


# DeepSpeed 0.19.8's gradient_clipping where a config names none (runtime/constants.py GRADIENT_CLIPPING_DEFAULT).
DEEPSPEED_DEFAULT_CLIPPING = 1.0


def settings_for_device(settings: Mapping[str, Any], *, cuda: bool) -> tuple[dict[str, Any], float, list[str]]:
    """The DeepSpeed settings that keep the GPU fed, and the gradient clipping the job applies itself.

    - DeepSpeed's throughput timer is off unless the file configures it: by default it synchronizes the device
      at the start and the end of every step (``timers.throughput.synchronized``), which drains the GPU's queue.
    - On CUDA, torch's fused AdamW where DeepSpeed builds torch's Adam (``torch_adam``) and the file says nothing
      of ``fused``: one kernel for every parameter instead of several per tensor. (On CPUs the default stays.)
    - The job clips gradients itself, on the device, right before each optimizer step
      (``engine.clip_gradients_before_step``) wherever DeepSpeed would read the norm on the host each step: at ZeRO
      stage 0 with float32 weights (DeepSpeed's stage-0 clipping builds two tensors from host values) and under
      ZeRO 1/2 without fp16 (``is_invalid_grad_norm`` calls ``bool()`` on the norm). The file's
      ``gradient_clipping`` (DeepSpeed's default where it says none) becomes the returned value and DeepSpeed's
      is set to 0. Under ZeRO 1/2 DeepSpeed then need not compute the norm at all (``compute_grad_norm``), nor
      check bf16 gradients for overflow (``bf16.check_grad_overflow``, an ``.item()`` per step), unless the file
      says so: a non-finite gradient shows in the loss, which the loop reads every ``log_every_steps`` and which
      ends the run. Left to DeepSpeed: fp16 (its loss scaling needs the overflow check), optimizer offload and
      DeepSpeed's own bf16 optimizer (stage 1 with bf16 weights and a wider gradient accumulation dtype).

    :return: the settings, the norm the job clips to (0: none, or DeepSpeed clips), and one note per change.
    """
    result = json.loads(json.dumps(settings))
    notes = []
    if "throughput" not in (result.get("timers") or {}):
        result.setdefault("timers", {})["throughput"] = {"enabled": False}
        notes.append("timers.throughput: off (DeepSpeed's default synchronizes the device twice per step)")
    optimizer = result.get("optimizer") or {}
    params = optimizer.get("params") or {}
    if cuda and params.get("torch_adam") and "fused" not in params:
        params["fused"] = True
        notes.append("optimizer.params.fused: true (torch's fused AdamW on CUDA)")
    bf16, fp16 = (bool((result.get(key) or {}).get("enabled")) for key in ("bf16", "fp16"))
    zero = result.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    accumulation = (result.get("data_types") or {}).get("grad_accum_dtype")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
    zero_optimizer = stage in (1, 2) and not (fp16 or offload) and not (
        stage == 1 and bf16 and accumulation not in (None, "bf16", "bfloat16")
    )
    clip = 0.0
    if zero_optimizer or (stage == 0 and not (bf16 or fp16)):
        clip = float(result.get("gradient_clipping", DEEPSPEED_DEFAULT_CLIPPING))
        result["gradient_clipping"] = 0.0  # absent is not off: DeepSpeed would clip at its default as well
        if clip:
            notes.append(f"gradient_clipping {clip}: applied by the job before each optimizer step (stage {stage})")
    if zero_optimizer:
        if "compute_grad_norm" not in result["zero_optimization"]:
            result["zero_optimization"]["compute_grad_norm"] = False
            notes.append("zero_optimization.compute_grad_norm: false (its invalid-norm check reads the norm each step)")
        if bf16 and "check_grad_overflow" not in result["bf16"]:
            result["bf16"]["check_grad_overflow"] = False
            notes.append("bf16.check_grad_overflow: false (an .item() each step; a non-finite loss ends the run)")
    return result, clip, notes


def load_run_config(path: str | Path, presets_path: Path | None = None) -> RunConfig:
    """Read and validate a run config file.

    :param path: the JSON file the operator wrote.
    :param presets_path: the model presets file when the config does not name one; defaults to
        ``include/config/model_presets.json`` beside ``jobs/``.
    :raises ConfigError: the file cannot be read, is not a JSON object, or any field is invalid.
    """
    config_path = Path(path).resolve()
    data = _read_json_object(config_path, "run config")
    return parse_run_config(
        data, config_path=config_path, default_presets_path=presets_path or DEFAULT_MODEL_PRESETS_PATH
    )


def load_model_presets(path: Path) -> dict[str, ModelSpec]:
    """Read the model presets file: ``{"presets": {"<name>": {"hidden_sizes": [...], "dropout": 0.1}}}``.

    :raises ConfigError: naming the preset and field that is invalid.
    """
    data = _read_json_object(path, "model presets")
    presets = data.get("presets")
    if not isinstance(presets, dict) or not presets:
        raise ConfigError(f"model presets {path}: 'presets' must be a non-empty object of name -> preset")
    problems: list[str] = []
    specs: dict[str, ModelSpec] = {}
    for name, entry in presets.items():
        checker = _Checker(problems, prefix=f"presets.{name}.")
        if not isinstance(entry, dict):
            problems.append(f"presets.{name}: must be an object, got {entry!r}")
            continue
        hidden = checker.hidden_sizes(entry, "hidden_sizes", required=True)
        dropout = checker.fraction(entry, "dropout", default=0.0, allow_zero=True)
        if hidden is not None and dropout is not None:
            specs[name] = ModelSpec(hidden_sizes=hidden, dropout=dropout, preset=name)
    if problems:
        raise ConfigError(f"model presets {path} is invalid:\n  " + "\n  ".join(problems))
    return specs


def parse_run_config(data: Mapping[str, Any], *, config_path: Path, default_presets_path: Path) -> RunConfig:
    """Validate a run config already read from JSON.

    :param data: the decoded JSON object.
    :param config_path: where it came from: relative paths are read from its directory, and errors name it.
    :param default_presets_path: the model presets file used when ``model_presets_path`` is absent.
    :raises ConfigError: listing every invalid field.
    """
    problems: list[str] = []
    check = _Checker(problems)
    base_dir = config_path.parent

    unknown = sorted(key for key in data if key not in _KNOWN_KEYS and not str(key).startswith("_"))
    for key in unknown:
        problems.append(f"{key}: unknown field (known: {', '.join(sorted(_KNOWN_KEYS))})")

    features_root = check.text(data, "features_root")
    if features_root is not None and "://" not in features_root:
        features_root = str((base_dir / features_root).resolve())
    run_dir = check.path(data, "run_dir", base_dir)
    ds = _partition_dates(data, problems)
    model = _model_spec(data, check, problems, base_dir, default_presets_path)
    epochs = check.integer(data, "epochs", minimum=1, required=False)
    max_steps = check.integer(data, "max_steps", minimum=1, required=False)
    if data.get("epochs") is None and data.get("max_steps") is None:
        problems.append(
            "epochs / max_steps: give at least one (both: training stops at whichever comes first)"
        )
    batch_size = check.integer(data, "batch_size", minimum=1)
    learning_rate = check.positive_number(data, "learning_rate")
    checkpoint_every_steps = check.integer(data, "checkpoint_every_steps", minimum=1)
    keep_last = check.integer(data, "keep_last_checkpoints", minimum=1, required=False)
    seed = check.integer(data, "seed", minimum=0, maximum=_MAX_SEED)
    zero_stage = check.integer(data, "zero_stage", minimum=0, maximum=3)
    deepspeed_config = check.path(data, "deepspeed_config", base_dir)
    deepspeed_settings = None
    if deepspeed_config is not None:
        try:
            deepspeed_settings = _read_json_object(deepspeed_config, "DeepSpeed config")
        except ConfigError as error:
            problems.append(f"deepspeed_config: {error}")
        else:
            optimizer = deepspeed_settings.get("optimizer")
            if not isinstance(optimizer, dict) or not isinstance(optimizer.get("type"), str):
                problems.append(
                    f'deepspeed_config: {deepspeed_config} needs an "optimizer" section with a "type" '
                    "(DeepSpeed builds the optimizer)"
                )
    holdout_fraction = check.fraction(data, "holdout_fraction", default=0.2)
    log_every_steps = check.integer(data, "log_every_steps", minimum=1, required=False, default=10)
    progress_every_s = check.positive_number(data, "progress_every_s", default=5.0)
    gpu_sample_every_s = check.positive_number(data, "gpu_sample_every_s", default=5.0)
    heartbeat_every_s = check.positive_number(data, "heartbeat_every_s", default=5.0)
    torch_threads = check.integer(data, "torch_threads", minimum=1, required=False)
    collective_timeout_s = check.positive_number(data, "collective_timeout_s", default=300.0)
    allreduce_sample_every_steps = check.integer(
        data, "allreduce_sample_every_steps", minimum=1, required=False, default=25
    )
    gradient_accumulation_steps = check.integer(
        data, "gradient_accumulation_steps", minimum=1, required=False, default=1
    )
    precision = "auto" if data.get("precision") is None else data["precision"]
    if precision not in PRECISIONS:
        problems.append(f"precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    run_id = data.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        problems.append(f"run_id: must be a non-empty string when given, got {run_id!r}")
    tracking = parse_tracking(data.get("tracking"), base_dir, problems)
    labels = {} if data.get("labels") is None else data["labels"]
    if not isinstance(labels, dict):
        problems.append(f"labels: must be an object of free-form metadata, got {labels!r}")

    if problems:
        raise ConfigError(f"run config {config_path} is invalid:\n  " + "\n  ".join(problems))
    return RunConfig(
        config_path=config_path,
        features_root=features_root,
        ds=ds,
        run_dir=run_dir,
        model=model,
        epochs=epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        checkpoint_every_steps=checkpoint_every_steps,
        keep_last_checkpoints=keep_last,
        seed=seed,
        zero_stage=zero_stage,
        deepspeed_config=deepspeed_config,
        deepspeed_settings=deepspeed_settings,
        holdout_fraction=holdout_fraction,
        log_every_steps=log_every_steps,
        progress_every_s=progress_every_s,
        gpu_sample_every_s=gpu_sample_every_s,
        heartbeat_every_s=heartbeat_every_s,
        torch_threads=torch_threads,
        collective_timeout_s=collective_timeout_s,
        allreduce_sample_every_steps=allreduce_sample_every_steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
        precision=precision,
        run_id=run_id,
        labels=labels,
        tracking=tracking,
    )


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{what} {path} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what} {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _partition_dates(data: Mapping[str, Any], problems: list[str]) -> tuple[str, ...]:
    if ("ds" in data) == ("ds_range" in data):
        problems.append(
            'ds / ds_range: give exactly one: "ds": ["2026-01-01", ...] or '
            '"ds_range": {"start": "2026-01-01", "end": "2026-01-07"} (both ends included)'
        )
        return ()
    if "ds" in data:
        values = data["ds"]
        if not isinstance(values, list) or not values:
            problems.append(f"ds: must be a non-empty list of YYYY-MM-DD dates, got {values!r}")
            return ()
        bad = [value for value in values if not _is_date(value)]
        if bad:
            problems.append(f"ds: not YYYY-MM-DD dates: {bad!r}")
            return ()
        if len(set(values)) != len(values):
            problems.append(f"ds: lists a date more than once: {values!r}")
            return ()
        return tuple(sorted(values))
    window = data["ds_range"]
    if not isinstance(window, dict) or set(window) != {"start", "end"}:
        problems.append(f'ds_range: must be {{"start": "YYYY-MM-DD", "end": "YYYY-MM-DD"}}, got {window!r}')
        return ()
    if not (_is_date(window["start"]) and _is_date(window["end"])):
        problems.append(f"ds_range: start and end must be YYYY-MM-DD dates, got {window!r}")
        return ()
    if window["start"] > window["end"]:
        problems.append(f"ds_range: start {window['start']} is after end {window['end']}")
        return ()
    return dates_in_range(window["start"], window["end"])


def _is_date(value: object) -> bool:
    if not isinstance(value, str) or not _DS_RE.fullmatch(value):
        return False
    try:
        date.fromisoformat(value)
    except ValueError:
        return False
    return True


def _model_spec(
    data: Mapping[str, Any], check: _Checker, problems: list[str], base_dir: Path, default_presets_path: Path
) -> ModelSpec | None:
    model = data.get("model")
    if not isinstance(model, dict):
        problems.append(
            'model: must be {"preset": "<name>"} or {"hidden_sizes": [...], "dropout": 0.1}, '
            f"got {model!r}"
        )
        return None
    unknown = sorted(set(model) - {"preset", "hidden_sizes", "dropout"})
    if unknown:
        problems.append(f"model: unknown keys {unknown} (known: preset, hidden_sizes, dropout)")
    if ("preset" in model) == ("hidden_sizes" in model):
        problems.append("model: give exactly one of preset and hidden_sizes")
        return None
    model_check = _Checker(problems, prefix="model.")
    dropout = model_check.fraction(model, "dropout", default=None, allow_zero=True)
    if "hidden_sizes" in model:
        hidden = model_check.hidden_sizes(model, "hidden_sizes", required=True)
        return None if hidden is None else ModelSpec(hidden_sizes=hidden, dropout=dropout or 0.0)
    presets_path = check.path(data, "model_presets_path", base_dir, required=False) or default_presets_path
    try:
        presets = load_model_presets(presets_path)
    except ConfigError as error:
        problems.append(f"model_presets_path: {error}")
        return None
    name = model["preset"]
    if name not in presets:
        problems.append(
            f"model.preset: {name!r} is not in {presets_path} (presets: {', '.join(sorted(presets))})"
        )
        return None
    preset = presets[name]
    return preset if dropout is None else ModelSpec(preset.hidden_sizes, dropout, preset=name)


class _Checker:
    """Reads one field at a time, appending a message that names the field when it is invalid."""

    def __init__(self, problems: list[str], prefix: str = "") -> None:
        self._problems = problems
        self._prefix = prefix

    def _fail(self, key: str, rule: str, value: object) -> None:
        self._problems.append(f"{self._prefix}{key}: {rule}, got {value!r}")

    def text(self, data: Mapping[str, Any], key: str) -> str | None:
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            self._fail(key, "must be a non-empty string", value)
            return None
        return value

    def path(self, data: Mapping[str, Any], key: str, base_dir: Path, required: bool = True) -> Path | None:
        if data.get(key) is None and not required:
            return None
        value = self.text(data, key)
        return None if value is None else (base_dir / value).resolve()

    def integer(
        self,
        data: Mapping[str, Any],
        key: str,
        *,
        minimum: int,
        maximum: int | None = None,
        required: bool = True,
        default: int | None = None,
    ) -> int | None:
        if data.get(key) is None and not required:
            return default
        value = data.get(key)
        in_range = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        if in_range and maximum is not None:
            in_range = value <= maximum
        if not in_range:
            bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            self._fail(key, f"must be an integer {bounds}", value)
            return None
        return value

    def positive_number(
        self, data: Mapping[str, Any], key: str, default: float | None = None
    ) -> float | None:
        if data.get(key) is None and default is not None:
            return default
        value = data.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            self._fail(key, "must be a finite number > 0", value)
            return None
        return float(value)

    def fraction(
        self, data: Mapping[str, Any], key: str, *, default: float | None, allow_zero: bool = False
    ) -> float | None:
        if data.get(key) is None:
            return default
        value = data[key]
        low_ok = isinstance(value, int | float) and (value >= 0 if allow_zero else value > 0)
        if isinstance(value, bool) or not low_ok or not value < 1:
            self._fail(key, f"must be a number in {'[0, 1)' if allow_zero else '(0, 1)'}", value)
            return None
        return float(value)

    def hidden_sizes(self, data: Mapping[str, Any], key: str, *, required: bool) -> tuple[int, ...] | None:
        value = data.get(key)
        if value is None and not required:
            return None
        if (
            not isinstance(value, list)
            or not value
            or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in value)
        ):
            self._fail(key, "must be a non-empty list of integers >= 1 (hidden layer widths)", value)
            return None
        return tuple(value)
