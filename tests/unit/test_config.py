"""The pipeline config: mistakes fail at load time naming the file, the key and the expected type."""

from __future__ import annotations

import re
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
    monkeypatch.delenv("HYBRIDFLOW_SLO_P99_MS", raising=False)  # and the SLO, for its 2 shared cores
    config = load_pipeline_config()
    assert config.cluster.partition == "gpu-training"
    assert config.preflight.max_allreduce_share == 0.2
    assert config.serving.slo_p99_ms == config.serving.release.max_p99_ms == 50
    monkeypatch.setenv("HYBRIDFLOW_SLO_P99_MS", "500")
    assert load_pipeline_config().serving.release.max_p99_ms == 500


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
        ("recovery.stall_timeout_s", 5, "pipeline.recovery.stall_timeout_s: 5.0; expected a number >= 10"),
        ("recovery.stall_timeout_s", 1e6, "pipeline.recovery.stall_timeout_s: 1000000.0; expected a number <= 86400"),
        ("recovery.stall_floor_s", 5, "pipeline.recovery.stall_floor_s: 5.0; expected a number >= 10"),
        ("recovery.stall_floor_s", "30s", "pipeline.recovery.stall_floor_s: expected float, got str '30s'"),
        ("recovery.stall_factor", float("nan"), "pipeline.recovery.stall_factor: nan; expected a number >= 2"),
        ("recovery.stall_factor", float("inf"), "pipeline.recovery.stall_factor: inf; expected a number >= 2"),
        ("recovery.stall_factor", 1001, "pipeline.recovery.stall_factor: 1001.0; expected a number <= 1000"),
        ("recovery.stall_warm_up_steps", 0, "pipeline.recovery.stall_warm_up_steps: 0; expected an integer >= 1"),
        ("recovery.stall_warm_up_steps", 2.5, "pipeline.recovery.stall_warm_up_steps: expected int, got float 2.5"),
        ("recovery.stall_warm_up_steps", True, "pipeline.recovery.stall_warm_up_steps: expected int, got bool"),
        ("recovery.max_stall_restarts", -1, "pipeline.recovery.max_stall_restarts: -1; expected an integer >= 0"),
        ("recovery.failure_classes.cancelled.action", "ignore",
         "pipeline.recovery.failure_classes.cancelled.action: 'ignore'; expected one of requeue, retry, fail"),
        ("recovery.failure_classes.cancelled.runbook", "training", "failure_classes.cancelled.runbook: 'training'"),
        ("recovery.failure_classes.cancelled.runbook", "nowhere.md#x", "'nowhere.md#x'; no such file under"),
        ("recovery.failure_classes.cancelled.states", ["cancelled"], "cancelled.states[0]: 'cancelled'; expected"),
        ("recovery.failure_classes.cancelled.states", KeyError, "failure_classes.cancelled: matches nothing"),
        ("recovery.failure_classes.data_or_config_error.exit_codes", [True], "exit_codes[0]: True; expected an int"),
        ("recovery.failure_classes.data_or_config_error.exit_codes", "2", "exit_codes: expected a list, got str"),
        ("recovery.failure_classes.cuda_out_of_memory.log_pattern", "CUDA (out", "is not a regular expression"),
        ("recovery.failure_classes.cancelled.when", "x", "failure_classes.cancelled: unknown key(s) when"),
        ("cluster.max_requeues", "three", "pipeline.cluster.max_requeues: expected int, got str 'three'"),
        ("cluster.max_requeues", True, "pipeline.cluster.max_requeues: expected int, got bool"),
        ("cluster.partition", KeyError, "pipeline.cluster.partition: missing (expected str)"),
        ("cluster.partiton", "x", "pipeline.cluster: unknown key(s) partiton"),
        ("preflight.max_allreduce_share", 20, "max_allreduce_share: 20.0 is not between 0 and 1"),
        ("preflight.ranks_per_node", 1, "an all-reduce needs at least 2 ranks"),
        ("preflight.nodes", 0, "expected a positive integer"),
        ("nightly.nodes", 0, "expected a positive integer"),
        ("nightly.gradient_accumulation_steps", 0, "expected a positive integer"),
        ("nightly.zero_stage", 4, "choose one of 0, 1, 2, 3"),
        ("nightly.zero_stage", -1, "choose one of 0, 1, 2, 3"),
        ("storage", "/data", "pipeline.storage: expected a mapping, got str"),
        ("storage.root", "${NOT_SET_ANYWHERE}", "environment variable NOT_SET_ANYWHERE is not set"),
        ("nightly.model_name", "bad name;rm", "pipeline.nightly.model_name: 'bad name;rm'"),
        # The registered model's name reaches MLflow's REST paths and the storage layout: refused unless plain.
        ("nightly.model_name", "../propensity", "pipeline.nightly.model_name: '../propensity'; use letters"),
        ("nightly.model_name", "propensity@champion", "model_name: 'propensity@champion'; use letters"),
        ("nightly.model_name", "p/1", "pipeline.nightly.model_name: 'p/1'; use letters"),
        ("nightly.model_name", "", "pipeline.nightly.model_name: ''; use letters"),
        ("nightly.model_name", "m" * 65, "use letters, digits, '_', '-' (1-64)"),
        ("nightly.model_name", "propensity\n", "pipeline.nightly.model_name: 'propensity\\n'; use letters"),
        ("nightly.model_name", 7, "pipeline.nightly.model_name: expected str, got int"),
        # An experiment name is stored verbatim (quotes, slashes, unicode are fine); empty, over-long or control
        # characters are refused.
        ("nightly.mlflow_experiment", "", "pipeline.nightly.mlflow_experiment: ''; use a non-empty name"),
        ("nightly.mlflow_experiment", "   ", "mlflow_experiment: '   '; use a non-empty name"),
        ("nightly.mlflow_experiment", "e" * 501, "use a non-empty name of at most 500 characters"),
        ("nightly.mlflow_experiment", "a\nb", "mlflow_experiment: 'a\\nb' holds control characters"),
        ("nightly.mlflow_experiment", "a\x00b", "holds control characters; use printable text"),
        ("nightly.mlflow_experiment", ["x"], "pipeline.nightly.mlflow_experiment: expected str, got list"),
        ("nightly.min_auc_gain", 1.5, "pipeline.nightly.min_auc_gain: 1.5; expected a value in [0, 1)"),
        ("nightly.gpus_per_node", 0, "pipeline.nightly.gpus_per_node: 0; expected a positive integer"),
        ("nightly.simulate_raw", "yes", "pipeline.nightly.simulate_raw: expected bool, got str 'yes'"),
        ("nightly.simulate_raw_rows", "${ROWS_FROM_ENV:-many}", "simulate_raw_rows: expected int, got str 'many'"),
        ("spark.driver_memory", "lots", "pipeline.spark.driver_memory: 'lots'; expected a size such as 1g"),
        ("costs.gpu_hour_usd", -1, "costs.gpu_hour_usd: -1.0; a price cannot be negative"),
        ("reconciler.grace_s", -1, "pipeline.reconciler.grace_s: -1; expected seconds from 0 to 86400"),
        ("reconciler.grace_s", 86_401, "pipeline.reconciler.grace_s: 86401; expected seconds from 0 to 86400"),
        ("reconciler.grace_s", "5m", "pipeline.reconciler.grace_s: expected int, got str '5m'"),
        ("reconciler", KeyError, "pipeline.reconciler: missing"),
        ("utilization.partitions", [], "pipeline.utilization.partitions: empty; expected at least one Slurm"),
        ("utilization.partitions", ["gpu;rm -rf /"], "pipeline.utilization.partitions[0]: 'gpu;rm -rf /'"),
        ("utilization.partitions", "gpu", "pipeline.utilization.partitions: expected a list, got str"),
        ("utilization.target", 0, "pipeline.utilization.target: 0.0; expected a share of available GPU-hours"),
        ("utilization.target", 60, "pipeline.utilization.target: 60.0; expected a share of available GPU-hours"),
        ("utilization.target", float("nan"), "pipeline.utilization.target: nan"),
        ("utilization.alert_days", 0, "pipeline.utilization.alert_days: 0; expected an integer >= 1"),
        ("utilization.alert_days", 2.5, "pipeline.utilization.alert_days: expected int, got float 2.5"),
        ("utilization.surprise", 1, "pipeline.utilization"),
        ("nightly.device", "tpu", "pipeline.nightly.device: 'tpu'; choose one of auto, gpu, cpu"),
        ("nightly.device", True, "pipeline.nightly.device: expected str, got bool"),
        ("serving.release.strategy", "blue-green", "pipeline.serving.release.strategy: 'blue-green'; choose "
                                                   "progressive or direct"),
        ("serving.release.canary_steps", [50, 10, 100], "canary_steps: [50, 10, 100]; steps must increase and end "
                                                        "at 100"),
        ("serving.release.canary_steps", [10, 50], "steps must increase and end at 100"),
        ("serving.release.canary_steps", [0, 100], "every step is a whole percentage in 1..100"),
        ("serving.release.canary_steps", [10.5, 100], "every step is a whole percentage in 1..100"),
        ("serving.release.canary_steps", [], "give increasing percentages ending at 100"),
        ("serving.release.canary_steps", "10,50,100", "serving.release.canary_steps: expected a list, got str"),
        ("serving.release.no_traffic", "ignore", "serving.release.no_traffic: 'ignore'; choose one of wait, promote"),
        ("serving.release.shadow_s", -1, "serving.release.shadow_s: -1.0; expected seconds >= 0"),
        ("serving.release.step_timeout_s", 0, "serving.release.step_timeout_s: 0.0; expected seconds > 0"),
        ("nightly.deploy", "sometimes", "pipeline.nightly.deploy: 'sometimes'; choose one of auto, always, never, ask"),
        ("nightly.deadline_min", 0, "pipeline.nightly.deadline_min: 0.0; expected minutes > 0"),
        ("nightly.deadline_min", "4h", "nightly.deadline_min: expected float, got str '4h'"),
        ("serving.release.approval_timeout_s", 0, "serving.release.approval_timeout_s: 0.0; expected seconds > 0"),
        ("serving.release.approval_timeout_s", float("inf"), "approval_timeout_s: inf; expected seconds > 0"),
        ("serving.release.approval_timeout_s", "4h", "approval_timeout_s: expected float, got str '4h'"),
        ("serving.release.step_min_s", 60, "step_min_s: 60.0 is over step_timeout_s 20.0; a step could never pass"),
        ("serving.release.min_requests", 0, "serving.release.min_requests: 0; expected a positive integer"),
        ("serving.release.max_psi", 0, "serving.release.max_psi: 0.0; expected a number above 0"),
        ("serving.release.max_error_rate", 2, "serving.release.max_error_rate: 2.0; expected a number in (0, 1]"),
        ("serving.release.max_p99_ms", "fast", "serving.release.max_p99_ms: expected float, got str 'fast'"),
        ("serving.release.canary", 10, "pipeline.serving.release: unknown key(s) canary"),
        ("nightly.zero_stage", 4, "pipeline.nightly.zero_stage: 4; choose one of 0, 1, 2, 3 or null (by the run's"),
        ("nightly.zero_stage_one_node", None, "nightly.zero_stage_one_node: expected int, got NoneType"),
        ("nightly.zero_stage_several_nodes", -1, "nightly.zero_stage_several_nodes: -1; choose one of 0, 1, 2, 3"),
        ("serving.release.latency_quantiles", [99, 50], "serving.release.latency_quantiles: (99, 50); give increasing"),
        ("serving.release.latency_quantiles", 99, "serving.release.latency_quantiles: expected a list, got int"),
        ("serving.release.confidence", 1.0, "serving.release.confidence: 1.0; expected a probability in [0.5, 1)"),
        ("serving.release.max_latency_ratio", 0.9, "serving.release.max_latency_ratio: 0.9; expected a number above 1"),
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


SMALL_CPU = "placement.training.small.cpu"


# The placement section (hybridflow.pipeline.placement): each class of bad value names its key.
@pytest.mark.parametrize("path, value, message", [
    (f"{SMALL_CPU}.rows_per_s", -5, f"pipeline.{SMALL_CPU}.rows_per_s: -5.0; expected a positive number of rows "
                                    "per second, or null (not measured)"),
    (f"{SMALL_CPU}.rows_per_s", 0, f"pipeline.{SMALL_CPU}.rows_per_s: 0.0; expected a positive number"),
    (f"{SMALL_CPU}.rows_per_s", float("inf"), f"pipeline.{SMALL_CPU}.rows_per_s: inf; expected a positive number"),
    (f"{SMALL_CPU}.rows_per_s", float("nan"), f"pipeline.{SMALL_CPU}.rows_per_s: nan; expected a positive number"),
    (f"{SMALL_CPU}.rows_per_s", "fast", f"pipeline.{SMALL_CPU}.rows_per_s: expected float, got str 'fast'"),
    (f"{SMALL_CPU}.rows_per_s", True, f"pipeline.{SMALL_CPU}.rows_per_s: expected float, got bool True"),
    (f"{SMALL_CPU}.rows_per_s", KeyError, f"pipeline.{SMALL_CPU}.rows_per_s: missing"),
    (f"{SMALL_CPU}.measured", "", f"pipeline.{SMALL_CPU}.measured: ''; expected non-empty text"),
    (f"{SMALL_CPU}.measured", KeyError, f"pipeline.{SMALL_CPU}.measured: missing (expected str)"),
    (f"{SMALL_CPU}.speed", 1, f"pipeline.{SMALL_CPU}: unknown key(s) speed"),
    ("placement.training.small.tpu", {"rows_per_s": 1, "measured": "x"},
     "pipeline.placement.training.small: unknown key(s) tpu"),
    ("placement.training.small.gpu", KeyError, "pipeline.placement.training.small.gpu: missing"),
    ("placement.training.huge", {"cpu": {"rows_per_s": 1, "measured": "x"}, "gpu": {"rows_per_s": 1, "measured": "x"}},
     "pipeline.placement.training.huge: not a model preset; expected one of tiny, small, large"),
    ("placement.training", ["small"], "pipeline.placement.training: expected a mapping, got list"),
    ("placement.training.small", 17600, "pipeline.placement.training.small: expected a mapping, got int"),
    ("placement.min_gpu_speedup", 0.5, "pipeline.placement.min_gpu_speedup: 0.5; expected a number >= 1"),
    ("placement.min_gpu_speedup", -10, "pipeline.placement.min_gpu_speedup: -10.0; expected a number >= 1"),
    ("placement.min_gpu_speedup", "10x", "pipeline.placement.min_gpu_speedup: expected float, got str '10x'"),
    ("placement.cpu_partition", "cpu;id", "pipeline.placement.cpu_partition: 'cpu;id'; expected text matching"),
    ("placement.cpu_partition", 7, "pipeline.placement.cpu_partition: expected str, got int 7"),
    ("placement.gpu_partition", "gpu", "pipeline.placement: unknown key(s) gpu_partition"),
    ("placement.evaluation.max_cpu_s", 0, "pipeline.placement.evaluation.max_cpu_s: 0.0; expected a positive number"),
    ("placement.evaluation.max_cpu_s", -30, "pipeline.placement.evaluation.max_cpu_s: -30.0; expected a positive"),
    ("placement.evaluation.cpu_parameter_rows_per_s", 0,
     "pipeline.placement.evaluation.cpu_parameter_rows_per_s: 0.0; expected a positive number of parameter-rows"),
    ("placement.evaluation.gpu_parameter_rows_per_s", "2e13",
     "pipeline.placement.evaluation.gpu_parameter_rows_per_s: expected float, got str '2e13'"),
    ("placement.evaluation.holdout_fraction", 1.0, "holdout_fraction: 1.0; expected a value in (0, 1)"),
    ("placement.evaluation.holdout_fraction", 0, "holdout_fraction: 0.0; expected a value in (0, 1)"),
    ("placement.evaluation.gpus", 0, "pipeline.placement.evaluation.gpus: 0; expected 1 to 8 GPUs"),
    ("placement.evaluation.gpus", 1.5, "pipeline.placement.evaluation.gpus: expected int, got float 1.5"),
    ("placement", "auto", "pipeline.placement: expected a mapping, got str"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_config_placement_mistakes_name_file_key_and_value(tmp_path, path, value, message):
    config_file = write(tmp_path, mutate(path, value))
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(config_file)
    assert str(err.value).startswith(f"{config_file}: ")
    assert message in str(err.value)


@pytest.mark.parametrize("path, value", [
    (f"{SMALL_CPU}.rows_per_s", None),  # not measured: allowed, the rule says so
    (f"{SMALL_CPU}.rows_per_s", 17600),  # an int is a number of rows per second
    ("placement.training", {}),
    ("placement.evaluation.cpu_parameter_rows_per_s", None),
])
def test_config_placement_accepts_not_measured_figures(tmp_path, path, value):
    load_pipeline_config(write(tmp_path, mutate(path, value)))


def test_config_without_a_placement_section_keeps_every_run_on_the_gpu(tmp_path):
    """An older pipeline.yaml (no placement section): no figures, so every preset keeps the GPU."""
    config = load_pipeline_config(write(tmp_path, mutate("placement", KeyError)))
    assert config.placement.training == {} and config.placement.cpu_partition == "cpu"
    assert config.placement.evaluation.cpu_parameter_rows_per_s is None


def test_config_checked_in_placement_figures_say_where_and_when_they_were_measured():
    placement = load_pipeline_config().placement
    assert set(placement.training) <= set(model_preset_names())
    for preset, rates in placement.training.items():
        for side in ("cpu", "gpu"):
            rate = getattr(rates, side)
            if rate.rows_per_s is None:
                assert "not measured" in rate.measured, (preset, side)
            else:
                where = "machine" in rate.measured or "node" in rate.measured
                assert where and re.search(r"20[0-9]{2}-[0-9]{2}", rate.measured), (preset, side, rate.measured)


def test_every_allowed_zero_stage_has_its_shipped_deepspeed_config():
    """prepare_training points the job at include/deepspeed/zero<stage>.json."""
    from hybridflow.config import ZERO_STAGES
    from hybridflow.paths import include_dir

    assert [stage for stage in ZERO_STAGES if not (include_dir() / "deepspeed" / f"zero{stage}.json").is_file()] == []


@pytest.mark.parametrize("path, value, message", [
    ("storage.root", "relative/storage", "pipeline.storage.root: 'relative/storage'; expected an absolute path or "
                                         "s3://bucket/prefix"),
    ("storage.root", "", "pipeline.storage.root: ''; expected an absolute path or s3://bucket/prefix"),
    ("storage.root", "gs://bucket/prefix", "pipeline.storage.root: 'gs://bucket/prefix'; expected an absolute path"),
    ("storage.root", "s3a://bucket/prefix", "pipeline.storage.root: 's3a://bucket/prefix'; expected an absolute"),
    ("storage.root", "s3://", "pipeline.storage.root: 's3://' names no bucket; expected s3://bucket/prefix"),
    ("storage.root", "s3:///prefix", "pipeline.storage.root: 's3:///prefix' names no bucket"),
    ("storage.root", 7, "pipeline.storage.root: expected str, got int 7"),
    ("storage.conn_id", "", "pipeline.storage.conn_id: empty; name the `aws` connection"),
    ("storage.bucket", "b", "pipeline.storage: unknown key(s) bucket"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_config_storage_root_is_an_absolute_path_or_an_s3_uri(tmp_path, path, value, message):
    config_file = write(tmp_path, mutate(path, value))
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(config_file)
    assert message in str(err.value)


@pytest.mark.parametrize("root", ["/var/lib/hybridflow/storage", "s3://bucket", "s3://bucket/some/prefix"])
def test_config_storage_root_takes_a_path_or_an_s3_uri(tmp_path, root):
    storage = load_pipeline_config(write(tmp_path, mutate("storage.root", root))).storage
    assert (storage.root, storage.conn_id) == (root, "storage_s3")
