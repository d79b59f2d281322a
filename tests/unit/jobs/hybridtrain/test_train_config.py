"""Run config validation of jobs/train.py: every bad field is named; the shipped configs are valid."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hybridtrain.config import (
    _KNOWN_KEYS,
    DEFAULT_MODEL_PRESETS_PATH,
    ModelSpec,
    deepspeed_settings_for_run,
    load_model_presets,
    load_run_config,
)
from hybridtrain.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[4]
ZERO1 = REPO / "include" / "deepspeed" / "zero1.json"


def valid_config(**changes: object) -> dict:
    config = {
        "run_id": "nightly__2026-01-02",
        "features_root": "/data/features",
        "ds": ["2026-01-02", "2026-01-01"],
        "run_dir": "/data/runs/r1",
        "model": {"preset": "tiny"},
        "epochs": 2,
        "batch_size": 64,
        "learning_rate": 0.01,
        "checkpoint_every_steps": 50,
        "seed": 7,
        "zero_stage": 1,
        "deepspeed_config": str(ZERO1),
    }
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    return config


_DROP = object()


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


def test_training_config_accepts_the_documented_fields(tmp_path):
    config = load_run_config(
        write_config(
            tmp_path,
            valid_config(
                max_steps=500,
                keep_last_checkpoints=3,
                holdout_fraction=0.25,
                log_every_steps=5,
                progress_every_s=2,
                gpu_sample_every_s=1.5,
                torch_threads=2,
                collective_timeout_s=120,
                allreduce_sample_every_steps=10,
                gradient_accumulation_steps=4,
                labels={"dag_id": "nightly"},
                _comment="ignored",
            ),
        )
    )
    assert config.ds == ("2026-01-01", "2026-01-02")
    assert config.model == ModelSpec(hidden_sizes=(16,), dropout=0.0, preset="tiny")
    assert (config.epochs, config.max_steps, config.batch_size, config.learning_rate) == (2, 500, 64, 0.01)
    assert (config.keep_last_checkpoints, config.holdout_fraction, config.torch_threads) == (3, 0.25, 2)
    assert (
        config.collective_timeout_s,
        config.allreduce_sample_every_steps,
        config.gradient_accumulation_steps,
    ) == (120.0, 10, 4)
    assert config.deepspeed_settings["optimizer"]["params"]["torch_adam"] is True
    assert config.checkpoints_dir == Path("/data/runs/r1/checkpoints")
    assert config.export_dir == Path("/data/runs/r1/export")


def test_training_config_defaults_and_relative_paths(tmp_path):
    (tmp_path / "ds.json").write_text(ZERO1.read_text())
    config = load_run_config(
        write_config(
            tmp_path,
            valid_config(
                features_root="features",
                run_dir="runs/r1",
                deepspeed_config="ds.json",
                ds=_DROP,
                ds_range={"start": "2026-02-27", "end": "2026-03-01"},
            ),
        )
    )
    assert config.features_root == str(tmp_path / "features")
    assert config.run_dir == tmp_path / "runs" / "r1"
    assert config.deepspeed_config == tmp_path / "ds.json"
    assert config.ds == ("2026-02-27", "2026-02-28", "2026-03-01")
    assert (config.holdout_fraction, config.log_every_steps, config.progress_every_s) == (0.2, 10, 5.0)
    assert (config.gpu_sample_every_s, config.keep_last_checkpoints, config.torch_threads) == (
        5.0,
        None,
        None,
    )
    assert (
        config.collective_timeout_s,
        config.allreduce_sample_every_steps,
        config.gradient_accumulation_steps,
    ) == (300.0, 25, 1)


def test_training_config_null_optional_fields_take_defaults(tmp_path):
    nulls = dict.fromkeys(
        [
            "max_steps",
            "keep_last_checkpoints",
            "holdout_fraction",
            "log_every_steps",
            "progress_every_s",
            "gpu_sample_every_s",
            "torch_threads",
            "collective_timeout_s",
            "allreduce_sample_every_steps",
            "gradient_accumulation_steps",
            "model_presets_path",
            "labels",
            "run_id",
        ]
    )
    config = load_run_config(write_config(tmp_path, valid_config(**nulls)))
    assert (config.max_steps, config.keep_last_checkpoints, config.holdout_fraction) == (None, None, 0.2)
    assert (config.log_every_steps, config.torch_threads, config.labels, config.run_id) == (
        10,
        None,
        {},
        None,
    )
    assert (config.collective_timeout_s, config.allreduce_sample_every_steps) == (300.0, 25)
    assert config.gradient_accumulation_steps == 1
    only_steps = load_run_config(write_config(tmp_path, valid_config(epochs=None, max_steps=9)))
    assert (only_steps.epochs, only_steps.max_steps) == (None, 9)


def test_training_config_keeps_uri_features_root(tmp_path):
    config = load_run_config(write_config(tmp_path, valid_config(features_root="s3://bucket/features")))
    assert config.features_root == "s3://bucket/features"


def test_training_config_model_from_hidden_sizes_or_preset_with_dropout(tmp_path):
    explicit = load_run_config(
        write_config(tmp_path, valid_config(model={"hidden_sizes": [8, 4], "dropout": 0.1}))
    )
    assert explicit.model == ModelSpec(hidden_sizes=(8, 4), dropout=0.1)
    preset = load_run_config(write_config(tmp_path, valid_config(model={"preset": "small", "dropout": 0.3})))
    assert preset.model == ModelSpec(hidden_sizes=(128, 64), dropout=0.3, preset="small")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"features_root": ""}, "features_root: must be a non-empty string"),
        ({"run_dir": _DROP}, "run_dir: must be a non-empty string"),
        ({"ds": _DROP}, "ds / ds_range: give exactly one"),
        ({"ds_range": {"start": "2026-01-01", "end": "2026-01-02"}}, "ds / ds_range: give exactly one"),
        ({"ds": []}, "ds: must be a non-empty list"),
        ({"ds": ["2026-02-30"]}, "ds: not YYYY-MM-DD dates"),
        ({"ds": ["2026-1-2"]}, "ds: not YYYY-MM-DD dates"),
        ({"ds": ["2026-01-01", "2026-01-01"]}, "ds: lists a date more than once"),
        (
            {"ds": _DROP, "ds_range": {"start": "2026-01-03", "end": "2026-01-01"}},
            "ds_range: start 2026-01-03 is after",
        ),
        ({"ds": _DROP, "ds_range": {"start": "2026-01-03"}}, "ds_range: must be"),
        ({"model": "tiny"}, "model: must be"),
        (
            {"model": {"preset": "tiny", "hidden_sizes": [4]}},
            "model: give exactly one of preset and hidden_sizes",
        ),
        ({"model": {"preset": "huge"}}, "model.preset: 'huge' is not in"),
        (
            {"model": {"hidden_sizes": [8, 0]}},
            "model.hidden_sizes: must be a non-empty list of integers >= 1",
        ),
        ({"model": {"hidden_sizes": []}}, "model.hidden_sizes: must be a non-empty list"),
        ({"model": {"hidden_sizes": [8], "dropout": 1.0}}, "model.dropout: must be a number in [0, 1)"),
        ({"model": {"hidden_sizes": [8], "layers": 2}}, "model: unknown keys ['layers']"),
        (
            {"model_presets_path": "/nowhere/presets.json"},
            "model_presets_path: model presets /nowhere/presets.json",
        ),
        ({"epochs": _DROP}, "epochs / max_steps: give at least one"),
        ({"epochs": None, "max_steps": None}, "epochs / max_steps: give at least one"),
        ({"epochs": 0}, "epochs: must be an integer >= 1, got 0"),
        ({"max_steps": 2.5}, "max_steps: must be an integer >= 1, got 2.5"),
        ({"batch_size": 0}, "batch_size: must be an integer >= 1, got 0"),
        ({"batch_size": True}, "batch_size: must be an integer >= 1, got True"),
        ({"batch_size": "64"}, "batch_size: must be an integer >= 1, got '64'"),
        ({"learning_rate": 0}, "learning_rate: must be a finite number > 0"),
        ({"learning_rate": "0.01"}, "learning_rate: must be a finite number > 0"),
        ({"checkpoint_every_steps": _DROP}, "checkpoint_every_steps: must be an integer >= 1, got None"),
        ({"learning_rate": None}, "learning_rate: must be a finite number > 0, got None"),
        ({"keep_last_checkpoints": 0}, "keep_last_checkpoints: must be an integer >= 1"),
        ({"seed": -1}, "seed: must be an integer from 0 to 4294967295"),
        ({"zero_stage": 4}, "zero_stage: must be an integer from 0 to 3, got 4"),
        (
            {"deepspeed_config": "/nowhere/ds.json"},
            "deepspeed_config: DeepSpeed config /nowhere/ds.json does not exist",
        ),
        ({"holdout_fraction": 1}, "holdout_fraction: must be a number in (0, 1)"),
        ({"holdout_fraction": 0}, "holdout_fraction: must be a number in (0, 1)"),
        ({"log_every_steps": 0}, "log_every_steps: must be an integer >= 1"),
        ({"progress_every_s": -5}, "progress_every_s: must be a finite number > 0"),
        ({"gpu_sample_every_s": float("inf")}, "gpu_sample_every_s: must be a finite number > 0"),
        ({"torch_threads": 0}, "torch_threads: must be an integer >= 1"),
        ({"collective_timeout_s": 0}, "collective_timeout_s: must be a finite number > 0, got 0"),
        ({"collective_timeout_s": "5m"}, "collective_timeout_s: must be a finite number > 0, got '5m'"),
        ({"collective_timeout_s": True}, "collective_timeout_s: must be a finite number > 0, got True"),
        ({"allreduce_sample_every_steps": 0}, "allreduce_sample_every_steps: must be an integer >= 1, got 0"),
        ({"allreduce_sample_every_steps": 2.5}, "allreduce_sample_every_steps: must be an integer >= 1"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: must be an integer >= 1, got 0"),
        ({"gradient_accumulation_steps": "2"}, "gradient_accumulation_steps: must be an integer >= 1, got '2'"),
        ({"run_id": ""}, "run_id: must be a non-empty string"),
        ({"labels": ["x"]}, "labels: must be an object"),
        ({"chekpoint_every_steps": 5}, "chekpoint_every_steps: unknown field"),
    ],
    ids=lambda value: None if isinstance(value, dict) else value.split(":")[0],
)
def test_training_config_rejects_invalid_field(tmp_path, changes, message):
    with pytest.raises(ConfigError) as raised:
        load_run_config(write_config(tmp_path, valid_config(**changes)))
    assert message in str(raised.value)
    assert str(tmp_path / "run.json") in str(raised.value)
    assert raised.value.exit_code == ExitCode.INVALID_INPUT


def test_training_config_reports_every_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_run_config(write_config(tmp_path, valid_config(batch_size=0, seed="x", zero_stage=9)))
    lines = str(raised.value).splitlines()
    assert [line.strip().split(":")[0] for line in lines[1:]] == ["batch_size", "seed", "zero_stage"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('{"gradient_clipping": 1.0}', 'needs an "optimizer" section with a "type"'),
    ],
)
def test_training_config_rejects_bad_deepspeed_config(tmp_path, content, message):
    (tmp_path / "ds.json").write_text(content)
    with pytest.raises(ConfigError, match="deepspeed_config: ") as raised:
        load_run_config(write_config(tmp_path, valid_config(deepspeed_config="ds.json")))
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "run config .* is not valid JSON"),
        ('"text"', "run config .* must hold a JSON object, got str"),
    ],
)
def test_training_config_rejects_unreadable_file(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_run_config(path)


def test_training_config_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"run config .*missing\.json does not exist"):
        load_run_config(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("presets", "message"),
    [
        ({}, "'presets' must be a non-empty object"),
        ({"presets": {"x": {"dropout": 0.1}}}, "presets.x.hidden_sizes: must be a non-empty list"),
        (
            {"presets": {"x": {"hidden_sizes": [4], "dropout": 2}}},
            "presets.x.dropout: must be a number in [0, 1)",
        ),
        ({"presets": {"x": [4]}}, "presets.x: must be an object"),
    ],
)
def test_training_model_presets_are_validated(tmp_path, presets, message):
    path = tmp_path / "presets.json"
    path.write_text(json.dumps(presets))
    with pytest.raises(ConfigError) as raised:
        load_model_presets(path)
    assert message in str(raised.value)


def test_training_shipped_model_presets_cover_tests_local_and_production():
    presets = load_model_presets(DEFAULT_MODEL_PRESETS_PATH)
    assert {"tiny", "small", "large"} <= set(presets)
    sizes = {name: sum(presets[name].hidden_sizes) for name in ("tiny", "small", "large")}
    assert sizes["tiny"] < sizes["small"] < sizes["large"]


SHIPPED_DEEPSPEED_CONFIGS = sorted((REPO / "include" / "deepspeed").glob("*.json"))


def test_training_ships_a_deepspeed_config_per_zero_stage():
    assert {path.name for path in SHIPPED_DEEPSPEED_CONFIGS} >= {"zero1.json", "zero2.json", "zero3.json"}


@pytest.mark.parametrize("path", SHIPPED_DEEPSPEED_CONFIGS, ids=lambda path: path.name)
def test_training_shipped_deepspeed_configs_need_no_jit_build(path):
    settings = json.loads(path.read_text())
    assert settings["zero_optimization"]["stage"] == int(path.name[len("zero")])
    assert settings["optimizer"]["type"] == "AdamW"
    assert settings["optimizer"]["params"]["torch_adam"] is True, "FusedAdam would JIT-compile on the cluster"
    assert not settings.get("fp16", {}).get("enabled")
    assert bool(settings.get("bf16", {}).get("enabled")) == path.name.endswith("_bf16.json")


def test_training_deepspeed_settings_take_the_run_config_values():
    settings = json.loads(ZERO1.read_text()) | {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 4,
    }
    result, notes = deepspeed_settings_for_run(
        settings, batch_size=64, world_size=2, learning_rate=0.05, zero_stage=3
    )
    assert result["train_micro_batch_size_per_gpu"] == 64
    assert result["train_batch_size"] == 128
    assert result["gradient_accumulation_steps"] == 1
    assert result["optimizer"]["params"]["lr"] == 0.05
    assert result["zero_optimization"]["stage"] == 3
    assert settings["zero_optimization"]["stage"] == 1, "the input is not modified"
    assert notes == [
        "train_micro_batch_size_per_gpu: 32 in the DeepSpeed config replaced by 64",
        "gradient_accumulation_steps: 4 in the DeepSpeed config replaced by 1",
        "zero_optimization.stage: 1 in the DeepSpeed config replaced by 3",
        "optimizer.params.lr: 0.001 in the DeepSpeed config replaced by 0.05",
    ]


@pytest.mark.parametrize(
    ("batch_size", "accumulation", "world_size", "global_batch"),
    [
        (64, 1, 1, 64),
        (64, 4, 1, 256),
        (64, 1, 8, 512),
        (32, 2, 4, 256),
    ],
    ids=["one-rank", "accumulation", "ranks", "both"],
)
def test_training_deepspeed_batch_is_micro_batch_x_accumulation_x_ranks(
    batch_size, accumulation, world_size, global_batch
):
    result, _ = deepspeed_settings_for_run(
        json.loads(ZERO1.read_text()),
        batch_size=batch_size,
        world_size=world_size,
        learning_rate=0.01,
        zero_stage=1,
        gradient_accumulation_steps=accumulation,
    )
    assert (
        result["train_micro_batch_size_per_gpu"],
        result["gradient_accumulation_steps"],
        result["train_batch_size"],
    ) == (batch_size, accumulation, global_batch)


def test_training_job_docstring_lists_every_run_config_key():
    """jobs/train.py's docstring is the run config's reference: every accepted key appears there."""
    docstring = ast.get_docstring(ast.parse((REPO / "jobs" / "train.py").read_text()))
    assert sorted(key for key in _KNOWN_KEYS if f'"{key}"' not in docstring) == []


ADAMW = {"type": "AdamW", "params": {"torch_adam": True}}
TIMERS_OFF = {"throughput": {"enabled": False}}


@pytest.mark.parametrize("settings, cuda, expected, clip, notes", [
    # stage 0, float32 weights: the job clips (DeepSpeed's stage-0 clip waits for the GPU), AdamW fused on CUDA
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}, True,
     {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 0.0}, 1.0, 3),
    # the same on CPUs: no fused kernel asked for
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}, False,
     {"timers": TIMERS_OFF, "fused": None, "gradient_clipping": 0.0}, 1.0, 2),
    # ZeRO 1/2: the job clips the partitions, DeepSpeed computes no norm (its invalid-norm check reads it)
    ({"optimizer": ADAMW, "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}, True,
     {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 0.0, "compute_grad_norm": False}, 0.5, 4),
    # DeepSpeed's bf16 weights under ZeRO 2: nor does it read the overflow flag
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
     True, {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 0.0, "compute_grad_norm": False,
            "check_grad_overflow": False}, 1.0, 5),
    # what the file says wins
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "bf16": {"enabled": True, "check_grad_overflow": True},
      "zero_optimization": {"stage": 2, "compute_grad_norm": True}, "timers": TIMERS_OFF}, True,
     {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 0.0, "compute_grad_norm": True,
      "check_grad_overflow": True}, 1.0, 2),
    # left to DeepSpeed: its bf16 optimizer (stage 0; stage 1 accumulating in fp32) and fp16's loss scaling
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}},
     True, {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 1.0}, 0.0, 2),
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "bf16": {"enabled": True},
      "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}, True,
     {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 1.0}, 0.0, 2),
    ({"optimizer": ADAMW, "gradient_clipping": 1.0, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
     True, {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 1.0}, 0.0, 2),
    ({"optimizer": ADAMW, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, True,
     {"timers": TIMERS_OFF, "fused": True, "gradient_clipping": 1.0}, 0.0, 2),
    # a file without gradient_clipping gets DeepSpeed's default, clipped by the job; one that turns it off, none
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": False}},
      "timers": {"throughput": {"enabled": True, "synchronized": False}}}, True,
     {"timers": {"throughput": {"enabled": True, "synchronized": False}}, "fused": False, "gradient_clipping": 0.0},
     1.0, 1),
    ({"optimizer": {"type": "AdamW", "params": {}}, "gradient_clipping": 0}, True,
     {"timers": TIMERS_OFF, "fused": None, "gradient_clipping": 0.0}, 0.0, 1),
], ids=["zero0-cuda", "zero0-cpu", "zero1", "zero2-deepspeed-bf16", "file-wins", "deepspeed-bf16-zero0",
        "deepspeed-bf16-zero1-fp32-accumulation", "fp16", "offload", "default-clipping", "clipping-off"])
def test_training_settings_for_device_never_wait_for_the_gpu(settings, cuda, expected, clip, notes):
    from hybridtrain.config import settings_for_device

    before = json.dumps(settings, sort_keys=True)
    tuned, job_clip, written = settings_for_device(settings, cuda=cuda)
    assert json.dumps(settings, sort_keys=True) == before, "the file's settings are not modified in place"
    assert tuned["timers"] == expected["timers"]
    assert tuned["optimizer"]["params"].get("fused") == expected["fused"]
    assert tuned.get("gradient_clipping") == expected["gradient_clipping"]
    assert (tuned.get("zero_optimization") or {}).get("compute_grad_norm") == expected.get("compute_grad_norm")
    assert (tuned.get("bf16") or {}).get("check_grad_overflow") == expected.get("check_grad_overflow")
    assert (job_clip, len(written)) == (clip, notes), written


def test_training_settings_know_deepspeeds_default_clipping():
    """A file without gradient_clipping is clipped at DeepSpeed's default, which settings_for_device names."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    from hybridtrain.config import DEEPSPEED_DEFAULT_CLIPPING

    assert DEEPSPEED_DEFAULT_CLIPPING == GRADIENT_CLIPPING_DEFAULT


@pytest.mark.parametrize("value, accepted", [
    (None, "auto"), ("auto", "auto"), ("fp32", "fp32"), ("bf16", "bf16"),
    ("fp16", None), ("", None), ("BF16", None), (16, None), (True, None), (["bf16"], None),
])
def test_training_precision_field(tmp_path, value, accepted):
    path = write_config(tmp_path, valid_config(precision=value))
    if accepted is None:
        with pytest.raises(ConfigError, match=r"precision: must be one of auto, fp32, bf16, got"):
            load_run_config(path)
    else:
        assert load_run_config(path).precision == accepted
