"""Workload routing (hybridflow.pipeline.routing) by tables: decisions, refusals, jobs' argv, rules errors."""

from __future__ import annotations

import copy

import pytest
import yaml
from hybridflow.config import load_pipeline_config
from hybridflow.exceptions import ConfigError, WorkloadSpecError
from hybridflow.paths import include_dir
from hybridflow.pipeline.routing import (
    SYSTEM_FIELDS,
    PlannedJob,
    WorkloadSpec,
    load_routing_rules,
    parse_routing_rules,
    plan_job,
    preset_router,
    route,
)

RULES_FILE = include_dir() / "config" / "routing.yaml"
RULES = load_routing_rules(RULES_FILE)
RAW = yaml.safe_load(RULES_FILE.read_text())
TYPES = ("feature_engineering", "model_training", "batch_inference", "realtime_inference")
MODEL = "/st/models/propensity/v2/model.pt"
SYSTEM = {"storage_root": "/st", "run_dir": "/st/runs/router/r1", "cluster_python": "/venv/bin/python",
          "cluster_jobs_dir": "/code/jobs", "model_path": MODEL, "model_version": "v2"}
STEP = ("/venv/bin/python", "/code/jobs/allreduce_bench.py", "--out", "/st/runs/router/r1/training_step.json",
        "--procs", "2", "--hidden-sizes")
LOCAL_SCORING = ("/venv/bin/python", "/code/jobs/score_batch_local.py")


def system(**overrides):
    values = {**SYSTEM, **overrides}
    return {name: (lambda name=name: values[name]) for name in SYSTEM_FIELDS}


def refusing_system(*refused):
    """System values where looking up any of ``refused`` fails the test (it must not be needed)."""

    def refuse(name):
        def lookup():
            raise AssertionError(f"{name} was looked up but the job does not use it")
        return lookup

    return {name: refuse(name) if name in refused else (lambda name=name: SYSTEM[name])
            for name in SYSTEM_FIELDS}


def test_routing_rules_file_defines_the_four_workload_types():
    assert RULES.workload_types == TYPES
    gpu, cpu = RULES.slurm["slurm_gpu"], RULES.slurm["slurm_cpu"]
    assert (gpu.partition, gpu.gpus_per_node) == ("gpu-training", 1)
    assert (cpu.partition, cpu.gpus_per_node) == ("cpu", 0)


@pytest.mark.parametrize(
    "workload_type, profile, side, target, rule",
    [
        ("feature_engineering", {}, "cpu", "spark", "default"),
        # ETL never pays GPU prices, whatever a profile says
        ("feature_engineering", {"gpu_speedup": 100, "arithmetic_intensity_flops_per_byte": 500},
         "cpu", "spark", "default"),
        ("model_training", {}, "gpu", "slurm_gpu", "default"),
        ("model_training", {"arithmetic_intensity_flops_per_byte": 2, "gpu_speedup": 1.2}, "cpu", "slurm_cpu",
         "too-small-for-a-gpu"),
        ("model_training", {"arithmetic_intensity_flops_per_byte": 2}, "gpu", "slurm_gpu", "default"),
        ("model_training", {"arithmetic_intensity_flops_per_byte": 2, "gpu_speedup": 6}, "gpu", "slurm_gpu",
         "default"),
        ("batch_inference", {}, "cpu", "spark", "default"),
        ("batch_inference", {"gpu_speedup": 8, "batch_rows": 2_000_000}, "gpu", "slurm_gpu", "gpu-pays-off"),
        ("batch_inference", {"gpu_speedup": 5, "batch_rows": 1_000_000}, "gpu", "slurm_gpu", "gpu-pays-off"),
        ("batch_inference", {"gpu_speedup": 8, "batch_rows": 999_999}, "cpu", "spark", "default"),
        ("batch_inference", {"gpu_speedup": 4.9, "batch_rows": 50_000_000}, "cpu", "spark", "default"),
        ("batch_inference", {"gpu_speedup": 8}, "cpu", "spark", "default"),
        ("realtime_inference", {}, "gpu", "triton", "default"),
        ("realtime_inference", {"cpu_p99_ms": 30}, "cpu", "triton", "cpu-meets-slo"),
        ("realtime_inference", {"cpu_p99_ms": 50}, "cpu", "triton", "cpu-meets-slo"),
        ("realtime_inference", {"cpu_p99_ms": 50.5}, "gpu", "triton", "cpu-misses-slo"),
    ],
)
def test_routing_decision_by_type_and_profile(workload_type, profile, side, target, rule):
    decision = route(WorkloadSpec(workload_type, {}, profile), RULES)
    assert (decision.side, decision.target, decision.rule) == (side, target, rule)
    assert decision.reason.startswith(f"{workload_type} -> {side} ({target})")
    assert decision.profile == {k: float(v) for k, v in profile.items()}


def test_routing_reason_names_the_measured_figures_and_why():
    decision = route(WorkloadSpec("batch_inference", {}, {"gpu_speedup": 8, "batch_rows": 2_000_000}), RULES)
    assert "gpu_speedup=8 >= 5 and batch_rows=2000000 >= 1000000" in decision.reason
    assert "much faster on a GPU" in decision.reason
    assert "no measured profile given" in route(WorkloadSpec("model_training"), RULES).reason
    unmet = route(WorkloadSpec("batch_inference", {}, {"gpu_speedup": 1}), RULES)
    assert "meets none of its rules" in unmet.reason


def test_routing_decision_as_dict_is_json_ready():
    decision = route(WorkloadSpec("feature_engineering", {"ds": "2026-01-05"}), RULES)
    assert decision.as_dict() == {
        "workload_type": "feature_engineering", "side": "cpu", "target": "spark", "rule": "default",
        "reason": decision.reason, "config": {"ds": "2026-01-05"}, "profile": {},
    }


def test_routing_spec_from_params_treats_missing_config_and_profile_as_empty():
    spec = WorkloadSpec.from_params({"workload_type": "model_training", "config": None, "dry_run": True})
    assert spec == WorkloadSpec("model_training", {}, {})


@pytest.mark.parametrize(
    "workload_type",
    ["training", "MODEL_TRAINING", "model_training; rm -rf /", "$(reboot)", "{{ conn.slurm_ssh.password }}",
     "model_training\n[INFO] forged log line", "x" * 10_000, "", None, 42, ["model_training"]],
    ids=["near-miss", "case", "shell", "subshell", "jinja", "newline", "huge", "empty", "none", "int",
         "list"],
)
def test_routing_unknown_type_is_refused_listing_the_valid_types(workload_type):
    with pytest.raises(WorkloadSpecError) as err:
        route(WorkloadSpec(workload_type), RULES)
    message = str(err.value)
    assert "is not a known workload type; valid types: " + ", ".join(TYPES) in message
    assert str(RULES_FILE) in message
    assert "\n" not in message and len(message) < 400  # shown as a short repr: no forged lines, no flood


@pytest.mark.parametrize(
    "workload_type, config, fragment",
    [
        ("model_training", {"script": "train.py"},
         "config: model_training does not accept 'script'; accepted: hidden_sizes (string, default 128,64)"),
        ("realtime_inference", {"ds": "2026-01-05"}, "does not accept 'ds'; accepted: none"),
        ("model_training", {"hidden_sizes": "128,64 --out /etc/passwd"},
         "config.hidden_sizes: '128,64 --out"),
        ("model_training", {"hidden_sizes": "$(id)"}, "config.hidden_sizes: '$(id)' does not match"),
        ("model_training", {"hidden_sizes": "128,64\n"}, "config.hidden_sizes: '128,64\\n' does not match"),
        ("model_training", {"hidden_sizes": 128}, "config.hidden_sizes: 128 is not a string"),
        ("model_training", {"batch": "1024"}, "config.batch: '1024' is not an integer"),
        ("model_training", {"batch": True}, "config.batch: True is not an integer"),
        ("model_training", {"batch": 0}, "config.batch: 0 is outside [1, 65536]"),
        ("model_training", {"batch": 10**9}, "config.batch: 1000000000 is outside [1, 65536]"),
        ("feature_engineering", {"ds": "2026-13-01"}, "config.ds: '2026-13-01' is not a date YYYY-MM-DD"),
        ("feature_engineering", {"ds": "2026-01-05; rm -rf /"},
         "config.ds: '2026-01-05; rm -rf /' is not a date"),
        ("feature_engineering", {"ds": "2026-01-05\n"}, "is not a date"),
        ("feature_engineering", {"ds": "20260105"}, "is not a date"),
        ("feature_engineering", "ds=2026-01-05", "config: expected an object"),
    ],
)
def test_routing_config_outside_the_whitelist_is_refused_naming_the_field(workload_type, config, fragment):
    with pytest.raises(WorkloadSpecError) as err:
        route(WorkloadSpec(workload_type, config), RULES)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "profile, fragment",
    [
        ({"gpu_utilisation": 0.9},
         "profile: unknown figure 'gpu_utilisation'; accepted: "
         "arithmetic_intensity_flops_per_byte, gpu_speedup, batch_rows, cpu_p99_ms"),
        ({"gpu_speedup": -1}, "profile.gpu_speedup: -1 is not a measured figure"),
        ({"gpu_speedup": float("nan")}, "profile.gpu_speedup: nan is not"),
        ({"gpu_speedup": float("inf")}, "profile.gpu_speedup: inf is not"),
        ({"gpu_speedup": "8"}, "profile.gpu_speedup: '8' is not"),
        ({"gpu_speedup": True}, "profile.gpu_speedup: True is not"),
        ([8], "profile: expected an object of measured figures"),
    ],
)
def test_routing_profile_that_is_not_measured_figures_is_refused(profile, fragment):
    with pytest.raises(WorkloadSpecError) as err:
        route(WorkloadSpec("batch_inference", {}, profile), RULES)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "workload_type, config, profile, expected",
    [
        ("feature_engineering", {"ds": "2026-01-05"}, {},
         PlannedJob("spark", "build_features.py",
                    ("--root", "/st", "--ds", "2026-01-05", "--lookback-days", "28"))),
        ("feature_engineering", {"ds": "2026-01-05", "lookback_days": 7}, {},
         PlannedJob("spark", "build_features.py",
                    ("--root", "/st", "--ds", "2026-01-05", "--lookback-days", "7"))),
        ("feature_engineering", {}, {}, PlannedJob("spark", "spark_healthcheck.py", ("100000",))),
        ("feature_engineering", {"rows": 5000}, {}, PlannedJob("spark", "spark_healthcheck.py", ("5000",))),
        ("batch_inference", {"ds": "2026-01-05"}, {},
         PlannedJob("spark", "score_batch.py",
                    ("--root", "/st", "--ds", "2026-01-05", "--model", MODEL, "--model-version", "v2"))),
        ("batch_inference", {"ds": "2026-01-05"}, {"gpu_speedup": 9, "batch_rows": 3_000_000},
         PlannedJob("slurm_gpu", command=(*LOCAL_SCORING, "--root", "/st", "--ds", "2026-01-05", "--model", MODEL,
                                          "--model-version", "v2"))),
        ("batch_inference", {"rows": 5000}, {"gpu_speedup": 9, "batch_rows": 3_000_000},
         PlannedJob("slurm_gpu", command=(*LOCAL_SCORING, "--probe-rows", "5000", "--model", MODEL,
                                          "--model-version", "v2"))),
        ("model_training", {}, {},
         PlannedJob("slurm_gpu", command=(*STEP, "128,64", "--batch", "1024", "--repeats", "5"))),
        ("model_training", {"hidden_sizes": "512,256,128", "batch": 64},
         {"arithmetic_intensity_flops_per_byte": 1, "gpu_speedup": 1},
         PlannedJob("slurm_cpu", command=(*STEP, "512,256,128", "--batch", "64", "--repeats", "5"))),
        ("realtime_inference", {}, {}, None),
    ],
)
def test_routing_plans_the_whole_argv_of_the_routed_job(workload_type, config, profile, expected):
    decision = route(WorkloadSpec(workload_type, config, profile), RULES)
    assert plan_job(decision, RULES, system()) == expected


def test_routing_looks_up_the_model_of_record_only_for_a_job_that_uses_it():
    for config in ({}, {"rows": 2000}):
        decision = route(WorkloadSpec("batch_inference", config), RULES)
        assert plan_job(decision, RULES, refusing_system("model_path", "model_version")).application == \
            "spark_healthcheck.py"


def permissive_rules():
    """The real rules plus a field that accepts almost any text, to show values stay inert data."""
    data = copy.deepcopy(RAW)
    data["workloads"]["model_training"]["fields"]["note"] = {
        "type": "string", "pattern": r"[^\x00]{0,200}", "default": "-", "description": "free text"}
    data["workloads"]["model_training"]["jobs"]["slurm_gpu"] = [
        {"command": ["echo", "note={note}", "{run_dir}"]}]
    return parse_routing_rules(data, "test rules")


@pytest.mark.parametrize(
    "hostile",
    ["{run_dir}", "{storage_root}/../../etc", "$(rm -rf /)", "`id`", "a; reboot", "x' && echo 'pwned",
     "{{ conn.slurm_ssh.password }}", "--out=/etc/passwd", "line1\nline2"],
)
def test_routing_hostile_config_values_stay_one_inert_argv_element(hostile):
    rules = permissive_rules()
    decision = route(WorkloadSpec("model_training", {"note": hostile}), rules)
    job = plan_job(decision, rules, system())
    assert job.command == ("echo", f"note={hostile}", SYSTEM["run_dir"])  # never expanded, split or re-read


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d["workloads"]["batch_inference"]["default"].update(target="yarn"),
         "routing.workloads.batch_inference.default.target: 'yarn'; "
         "expected one of spark, slurm_cpu, slurm_gpu"),
        (lambda d: d["workloads"]["feature_engineering"]["default"].update(side="gpu"),
         "routing.workloads.feature_engineering.default.side: 'gpu'; target spark runs on cpu"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0]["when"].update(gpu_speedup={"ge": 5}),
         "routing.workloads.batch_inference.rules[0].when.gpu_speedup: unknown operator 'ge'; "
         "use gte, gt, lte, lt"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0]["when"].update(gpu_speedup={"gte": "5"}),
         "rules[0].when.gpu_speedup.gte: '5'; expected a number"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0]["when"].update(gpu_speedup={"gte": "${NO_SUCH_VAR}"}),
         "rules[0].when.gpu_speedup.gte: environment variable NO_SUCH_VAR is not set and has no default"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0]["when"].update(gpu_speedup={"gte": "${X:-fast}"}),
         "rules[0].when.gpu_speedup.gte: 'fast'; expected a number"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0]["when"].update(gpu_hours={"gte": 5}),
         "rules[0].when.gpu_hours: unknown profile figure 'gpu_hours'"),
        (lambda d: d["workloads"]["batch_inference"]["rules"][0].pop("why"),
         "routing.workloads.batch_inference.rules[0].why: missing (required)"),
        (lambda d: d["workloads"]["model_training"]["jobs"]["slurm_gpu"][0]["command"].append("{script}"),
         "jobs.slurm_gpu[0]: unknown placeholder(s) {script}; "
         "use a field of the workload (hidden_sizes, batch, preset)"),
        (lambda d: d["workloads"]["model_training"]["jobs"]["slurm_gpu"][0].update(command="python train.py"),
         "jobs.slurm_gpu[0].command: expected a list of strings (an argv"),
        (lambda d: d["workloads"]["model_training"]["fields"].update(
            run_dir={"type": "date", "description": "x"}),
         "fields.run_dir: field name 'run_dir' must match"),
        (lambda d: d["workloads"]["model_training"]["fields"]["batch"].update(default=0),
         "fields.batch.default: 0 is outside [1, 65536]"),
        (lambda d: d["workloads"]["model_training"]["fields"]["batch"].pop("maximum"),
         "fields.batch: an integer field needs minimum and maximum"),
        (lambda d: d["workloads"]["model_training"]["fields"]["hidden_sizes"].update(pattern="[1-9"),
         "fields.hidden_sizes.pattern: '[1-9' is not a regular expression"),
        (lambda d: d["workloads"]["feature_engineering"]["jobs"]["spark"].pop(),
         "feature_engineering.jobs.spark: the workload can be routed to spark, so it needs a job variant "
         "whose fields all have defaults"),
        (lambda d: d["workloads"]["model_training"]["jobs"].pop("slurm_cpu"),
         "model_training.jobs.slurm_cpu: the workload can be routed to slurm_cpu"),
        (lambda d: d["workloads"]["feature_engineering"]["jobs"]["spark"][0].update(application="../x.py"),
         "jobs.spark[0].application: '../x.py'; expected text matching"),
        (lambda d: d["workloads"]["realtime_inference"]["jobs"].update(triton=[{"command": ["x"]}]),
         "realtime_inference.jobs.triton: expected one of spark, slurm_cpu, slurm_gpu"),
        (lambda d: d["targets"]["slurm_gpu"].update(gpus_per_node=0),
         "routing.targets.slurm_gpu.gpus_per_node: 0; slurm_gpu needs GPUs"),
        (lambda d: d["targets"]["slurm_cpu"].update(partition="cpu; rm"),
         "routing.targets.slurm_cpu.partition: 'cpu; rm'; expected text matching"),
        (lambda d: d["targets"].pop("slurm_cpu"), "routing.targets.slurm_cpu: missing"),
        (lambda d: d["targets"]["slurm_cpu"].update(cpus_per_task=0),
         "routing.targets.slurm_cpu.cpus_per_task: 0; expected an integer >= 1"),
        (lambda d: d["targets"]["slurm_cpu"].update(gpu=1),
         "routing.targets.slurm_cpu: unknown key(s) gpu; expected some of cpus_per_task, gpus_per_node"),
        (lambda d: d["workloads"].update({"Bad Type": d["workloads"]["model_training"]}),
         "routing.workloads: type name 'Bad Type' must match"),
        (lambda d: d.update(extra=1), "routing: unknown key(s) extra"),
        (lambda d: d["workloads"]["model_training"].update(preset_field="model"),
         "routing.workloads.model_training.preset_field: 'model'; name a string field of the workload "
         "(hidden_sizes, preset)"),
        (lambda d: d["workloads"]["model_training"].update(preset_field="batch"),
         "model_training.preset_field: 'batch'; name a string field"),
        (lambda d: d["workloads"]["feature_engineering"].update(preset_field="ds"),
         "feature_engineering.preset_field: 'ds'; name a string field of the workload (none)"),
    ],
)
def test_routing_rules_errors_name_the_file_and_the_key(mutate, fragment):
    data = copy.deepcopy(RAW)
    mutate(data)
    with pytest.raises(ConfigError) as err:
        parse_routing_rules(data, "/etc/hybridflow/routing.yaml")
    assert str(err.value).startswith("/etc/hybridflow/routing.yaml: ")
    assert fragment in str(err.value)


def test_routing_rules_file_that_is_not_yaml_names_the_file(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("workloads: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read the routing rules"):
        load_routing_rules(path)


@pytest.mark.parametrize("stack_slo", [None, "500"])
def test_routing_realtime_budget_matches_the_serving_slo(monkeypatch, stack_slo):
    """One budget: the router's realtime rules follow serving.slo_p99_ms, also where the local stack raises it."""
    if stack_slo is None:
        monkeypatch.delenv("HYBRIDFLOW_SLO_P99_MS", raising=False)
    else:
        monkeypatch.setenv("HYBRIDFLOW_SLO_P99_MS", stack_slo)
    slo = load_pipeline_config().serving.slo_p99_ms
    realtime = load_routing_rules().workloads["realtime_inference"]
    thresholds = {c.threshold for rule in realtime.rules for c in rule.conditions if c.metric == "cpu_p99_ms"}
    assert thresholds == {slo} == {float(stack_slo or 50)}


# A workload naming a preset routes by nightly_training's placement rule (pipeline.yaml placement).
PRESETS = preset_router(load_pipeline_config())


@pytest.mark.parametrize("config, profile, side, target, rule, hidden", [
    ({"preset": "small"}, {}, "cpu", "slurm_cpu", "preset-placement", "128,64"),
    ({"preset": "large"}, {}, "gpu", "slurm_gpu", "preset-placement", "4096,4096,2048,1024"),
    ({"preset": "tiny"}, {}, "gpu", "slurm_gpu", "preset-placement", "16"),  # GPU figure not measured: default
    ({"preset": "small", "hidden_sizes": "32"}, {}, "cpu", "slurm_cpu", "preset-placement", "32"),  # given wins
    # a measured profile that meets a rule decides first, as before
    ({"preset": "large"}, {"arithmetic_intensity_flops_per_byte": 4, "gpu_speedup": 1.5}, "cpu", "slurm_cpu",
     "too-small-for-a-gpu", None),
    ({"preset": "small"}, {"gpu_speedup": 50}, "cpu", "slurm_cpu", "preset-placement", "128,64"),
    ({}, {}, "gpu", "slurm_gpu", "default", None),  # no preset: as before
], ids=["small-cpu", "large-gpu", "tiny-not-measured", "hidden-sizes-given", "profile-first",
        "profile-meets-no-rule", "no-preset"])
def test_routing_model_training_by_preset_placement(config, profile, side, target, rule, hidden):
    decision = route(WorkloadSpec("model_training", config, profile), RULES, PRESETS)
    assert (decision.side, decision.target, decision.rule) == (side, target, rule), decision.reason
    assert decision.config.get("hidden_sizes") == hidden
    if rule == "preset-placement":
        assert f"placement rule of nightly_training for preset {config['preset']}" in decision.reason


def test_routing_preset_small_reason_names_the_figures_and_the_job_trains_that_network():
    decision = route(WorkloadSpec("model_training", {"preset": "small"}), RULES, PRESETS)
    assert "CPU 80k rows/s" in decision.reason and "GPU 40k rows/s" in decision.reason
    assert decision.reason.endswith("-> cpu partition")
    job = plan_job(decision, RULES, system())
    assert job.target == "slurm_cpu" and ("--hidden-sizes", "128,64") == job.command[-6:-4]


def test_routing_preset_is_ignored_without_the_placement_rule():
    """route() without a preset router (its callers before placement existed) keeps the type's default."""
    assert route(WorkloadSpec("model_training", {"preset": "small"}), RULES).rule == "default"


@pytest.mark.parametrize("preset, fragment", [
    ("huge", "config.preset: 'huge' is not a model preset; valid presets: tiny, small, large"),
    ("Small", "config.preset: 'Small' does not match"),
    (7, "config.preset: 7 is not a string"),
])
def test_routing_unknown_preset_is_refused_naming_the_field(preset, fragment):
    with pytest.raises(WorkloadSpecError) as err:
        route(WorkloadSpec("model_training", {"preset": preset}), RULES, PRESETS)
    assert fragment in str(err.value)
