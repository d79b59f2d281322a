"""The pipeline config: mistakes fail at load time naming the file, the key and the expected type."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.nested import change_at
from hybridflow.config import (
    check_integer,
    check_keys,
    check_mapping,
    check_number,
    check_one_of,
    check_text,
    load_pipeline_config,
    model_preset_names,
)
from hybridflow.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[2]
GOOD = yaml.safe_load((REPO / "include/config/pipeline.yaml").read_text())


def write(tmp_path, data) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_config_checked_in_file_loads(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_MAX_ALLREDUCE_SHARE", raising=False)  # the local stack raises it for gloo
    config = load_pipeline_config()
    assert config.cluster.partition == "gpu-training"
    assert config.preflight.max_allreduce_share == 0.2


def test_config_env_references_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", "/data/lake")
    assert load_pipeline_config(write(tmp_path, GOOD)).storage.root == "/data/lake"
    monkeypatch.delenv("HYBRIDFLOW_STORAGE_ROOT")
    assert load_pipeline_config(write(tmp_path, GOOD)).storage.root == "/var/lib/hybridflow/storage"


def mutate(path: str, value):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    change_at(data, path.split("."), value, delete_marker=KeyError)
    return data


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("cluster.max_requeues", "three", "pipeline.cluster.max_requeues: expected int, got str 'three'"),
        ("cluster.max_requeues", True, "pipeline.cluster.max_requeues: expected int, got bool"),
        ("cluster.partition", KeyError, "pipeline.cluster.partition: missing (expected str)"),
        ("cluster.partiton", "x", "pipeline.cluster: unknown key(s) partiton"),
        ("preflight.max_allreduce_share", 20, "max_allreduce_share: 20.0 is not between 0 and 1"),
        ("preflight.ranks_per_node", 1, "an all-reduce needs at least 2 ranks"),
        ("preflight.nodes", 0, "expected a positive integer"),
        ("nightly.nodes", 0, "expected a positive integer"),
        ("nightly.gradient_accumulation_steps", 0, "expected a positive integer"),
        ("nightly.zero_stage", 4, "choose one of 1, 2, 3"),
        ("storage", "/data", "pipeline.storage: expected a mapping, got str"),
        ("storage.root", "${NOT_SET_ANYWHERE}", "environment variable NOT_SET_ANYWHERE is not set"),
        ("nightly.model_name", "bad name;rm", "pipeline.nightly.model_name: 'bad name;rm'"),
        ("nightly.min_auc_gain", 1.5, "pipeline.nightly.min_auc_gain: 1.5; expected a value in [0, 1)"),
        ("nightly.gpus", 0, "pipeline.nightly.gpus: 0; expected a positive integer"),
        ("nightly.simulate_raw", "yes", "pipeline.nightly.simulate_raw: expected bool, got str 'yes'"),
        ("nightly.simulate_raw_rows", "${ROWS_FROM_ENV:-many}", "simulate_raw_rows: expected int, got str 'many'"),
        ("spark.driver_memory", "lots", "pipeline.spark.driver_memory: 'lots'; expected a size such as 1g"),
        ("costs.gpu_hour_usd", -1, "costs.gpu_hour_usd: -1.0; a price cannot be negative"),
        ("reconciler.grace_s", -1, "pipeline.reconciler.grace_s: -1; expected seconds from 0 to 86400"),
        ("reconciler.grace_s", 86_401, "pipeline.reconciler.grace_s: 86401; expected seconds from 0 to 86400"),
        ("reconciler.grace_s", "5m", "pipeline.reconciler.grace_s: expected int, got str '5m'"),
        ("reconciler", KeyError, "pipeline.reconciler: missing"),
    ],
)
def test_config_mistakes_name_file_key_and_type(tmp_path, path, value, message):
    config_file = write(tmp_path, mutate(path, value))
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(config_file)
    assert str(config_file) in str(err.value)
    assert message in str(err.value)


def test_config_unreadable_yaml_names_the_file(tmp_path):
    bad = tmp_path / "pipeline.yaml"
    bad.write_text("cluster: [unclosed\n")
    with pytest.raises(ConfigError, match=str(bad)):
        load_pipeline_config(bad)


@pytest.mark.parametrize(
    "env, expected",
    [({"HYBRIDFLOW_SIMULATE_RAW": "true", "HYBRIDFLOW_SIMULATE_RAW_ROWS": "1234"}, (True, 1234)),
     ({"HYBRIDFLOW_SIMULATE_RAW": "False"}, (False, 200_000)),
     ({}, (False, 200_000))],
)
def test_config_env_values_take_the_type_the_key_expects(tmp_path, monkeypatch, env, expected):
    for name in ("HYBRIDFLOW_SIMULATE_RAW", "HYBRIDFLOW_SIMULATE_RAW_ROWS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nightly = load_pipeline_config(write(tmp_path, GOOD)).nightly
    assert (nightly.simulate_raw, nightly.simulate_raw_rows) == expected


def test_model_presets_are_the_file_the_training_job_reads():
    from hybridtrain.config import DEFAULT_MODEL_PRESETS_PATH, load_model_presets

    assert model_preset_names() == tuple(load_model_presets(DEFAULT_MODEL_PRESETS_PATH))
    assert load_pipeline_config().nightly.model_preset in model_preset_names()


@pytest.mark.parametrize(
    "content, message",
    [("{", "cannot read the model presets"), ('{"presets": ["small"]}', "presets: expected a mapping, got list"),
     ('{"presets": {}}', "presets: {}; define at least one preset")],
)
def test_model_presets_file_mistakes_name_the_file(tmp_path, content, message):
    path = tmp_path / "model_presets.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        model_preset_names(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


@pytest.mark.parametrize(
    "check, args, message",
    [(check_keys, ({"a": 1, "z": 2}, "x", {"a"}, {"b"}), "x: unknown key(s) z; expected some of a, b"),
     (check_keys, ({}, "x", {"a"}), "x.a: missing (required)"),
     (check_mapping, ([], "x"), "x: expected a mapping, got list"),
     (check_text, (" ", "x.name"), "x.name: ' '; expected non-empty text"),
     (check_integer, (True, "x.n", 1), "x.n: True; expected an integer >= 1"),
     (check_number, (float("inf"), "x.v"), "x.v: inf; expected a number"),
     (check_number, (-1, "x.v", 0), "x.v: -1; expected a number >= 0"),
     (check_one_of, ("yarn", ("spark", "slurm"), "x.target"), "x.target: 'yarn'; expected one of spark, slurm")],
)
def test_config_checks_say_where_what_and_what_to_do(check, args, message):
    with pytest.raises(ConfigError) as err:
        check(*args)
    assert str(err.value) == message
