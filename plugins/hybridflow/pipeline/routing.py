"""Workload routing: which side of the hybrid estate runs a workload, and the job it runs there.

The rules come from ``include/config/routing.yaml`` (:func:`load_routing_rules`, validated when loaded, every
error naming the file and the key). :func:`route` decides from the workload type and, when given, a measured
profile or, for a workload that names a model preset (its ``preset_field``), the placement rule nightly_training
uses (hybridflow.pipeline.placement, :func:`preset_router`); :func:`plan_job` turns the decision into the job's
argv from the rules' templates. A user's config
values only fill whitelisted fields, each validated, one argv element at a time: a value is never parsed as a
template or a command line. Pure apart from reading the rules file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import date
from functools import lru_cache
from pathlib import Path
from typing import Any

from hybridflow.config import (
    ENV_REF,
    PipelineConfig,
    build,
    check_integer,
    check_keys,
    check_mapping,
    check_number,
    check_one_of,
    check_text,
    expand_env,
    from_environment,
    read_yaml,
)
from hybridflow.exceptions import ConfigError, WorkloadSpecError
from hybridflow.paths import include_dir

__all__ = [
    "PROFILE_METRICS",
    "PresetRoute",
    "SYSTEM_FIELDS",
    "TARGET_SIDES",
    "PlannedJob",
    "RouteDecision",
    "RoutingRules",
    "WorkloadSpec",
    "WorkloadSpecError",
    "load_routing_rules",
    "plan_job",
    "preset_router",
    "route",
    "routing_rules",
]

SIDES = ("cpu", "gpu")
# Where each target may run: Spark and the CPU partition are CPU only, the training partition is GPU only,
# Triton serves on either kind of instance.
TARGET_SIDES: Mapping[str, tuple[str, ...]] = {
    "spark": ("cpu",), "slurm_cpu": ("cpu",), "slurm_gpu": ("gpu",), "triton": ("cpu", "gpu"),
}
SLURM_TARGETS = ("slurm_cpu", "slurm_gpu")
PROFILE_METRICS: Mapping[str, str] = {
    "arithmetic_intensity_flops_per_byte": "FLOPs per byte of memory traffic (roofline), measured",
    "gpu_speedup": "time on CPU / time on GPU for the same work, measured",
    "batch_rows": "rows one run processes",
    "cpu_p99_ms": "p99 latency in ms of the model served on CPU, measured under load",
}
OPERATORS: Mapping[str, tuple[str, Callable[[float, float], bool]]] = {
    "gte": (">=", lambda value, threshold: value >= threshold),
    "gt": (">", lambda value, threshold: value > threshold),
    "lte": ("<=", lambda value, threshold: value <= threshold),
    "lt": ("<", lambda value, threshold: value < threshold),
}
# Values the orchestrator fills in templates; a config field may not take one of these names.
SYSTEM_FIELDS = ("storage_root", "run_dir", "cluster_python", "cluster_jobs_dir", "model_path",
                 "model_version")
FIELD_TYPES = ("integer", "string", "date")
PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
RULE_NAME = re.compile(r"[a-z][a-z0-9-]{0,63}")
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SPARK_APPLICATION = re.compile(r"[a-z][a-z0-9_]*\.py")
DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """A user value for a message: repr (one line, escapes visible), cut short."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:g}"


# --- the rules ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldRule:
    """One config field a workload accepts; ``check`` turns a value into the text of one argv element."""

    name: str
    type: str
    description: str
    default: Any = None
    minimum: int | None = None
    maximum: int | None = None
    pattern: str | None = None

    def check(self, value: Any, where: str) -> str:
        if self.type == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise WorkloadSpecError(f"{where}: {shown(value)} is not an integer")
            if not self.minimum <= value <= self.maximum:
                raise WorkloadSpecError(f"{where}: {value} is outside [{self.minimum}, {self.maximum}]")
            return str(value)
        if not isinstance(value, str):
            raise WorkloadSpecError(f"{where}: {shown(value)} is not a string")
        if self.type == "date":
            try:
                if not DATE.fullmatch(value):
                    raise ValueError
                date.fromisoformat(value)
            except ValueError:
                raise WorkloadSpecError(f"{where}: {shown(value)} is not a date YYYY-MM-DD") from None
            return value
        if not re.fullmatch(self.pattern, value):
            raise WorkloadSpecError(f"{where}: {shown(value)} does not match {self.pattern}")
        return value

    def describe(self) -> str:
        default = "" if self.default is None else f", default {self.default}"
        return f"{self.name} ({self.type}{default}): {self.description}"


@dataclass(frozen=True)
class Condition:
    metric: str
    operator: str
    threshold: float

    def holds(self, value: float) -> bool:
        return OPERATORS[self.operator][1](value, self.threshold)

    def describe(self, value: float) -> str:
        return f"{self.metric}={number(value)} {OPERATORS[self.operator][0]} {number(self.threshold)}"


@dataclass(frozen=True)
class Rule:
    name: str
    why: str
    side: str
    target: str
    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class JobTemplate:
    """One job variant: a Spark application (a file in jobs/) and its args, or a Slurm command's argv."""

    application: str | None = None
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()

    @property
    def placeholders(self) -> set[str]:
        return {name for text in (*self.args, *self.command) for name in PLACEHOLDER.findall(text)}


@dataclass(frozen=True)
class SlurmTarget:
    """The partition a Slurm target submits to and the shape of its jobs."""

    partition: str
    gpus_per_node: int
    cpus_per_task: int
    time_limit_min: int

    def validate(self, where: str) -> None:
        check_text(self.partition, f"{where}.partition", SLURM_NAME)
        check_integer(self.gpus_per_node, f"{where}.gpus_per_node", 0)
        check_integer(self.cpus_per_task, f"{where}.cpus_per_task", 1)
        check_integer(self.time_limit_min, f"{where}.time_limit_min", 1)


@dataclass(frozen=True)
class SlurmTargets:
    """``routing.targets``: the CPU and the GPU partition."""

    slurm_cpu: SlurmTarget
    slurm_gpu: SlurmTarget

    def validate(self, where: str) -> None:
        for name in SLURM_TARGETS:
            gpus = getattr(self, name).gpus_per_node
            if (gpus > 0) != (name == "slurm_gpu"):
                raise ConfigError(f"{where}.{name}.gpus_per_node: {gpus}; slurm_gpu needs GPUs, slurm_cpu none")


@dataclass(frozen=True)
class WorkloadRules:
    name: str
    description: str
    default_side: str
    default_target: str
    rules: tuple[Rule, ...]
    fields: Mapping[str, FieldRule]
    jobs: Mapping[str, tuple[JobTemplate, ...]]
    # the config field naming a model preset: when given, the placement rule routes it to slurm_cpu or slurm_gpu
    preset_field: str | None = None

    def targets(self) -> set[str]:
        preset_targets = set(SLURM_TARGETS) if self.preset_field else set()
        return {self.default_target, *(rule.target for rule in self.rules), *preset_targets}


@dataclass(frozen=True)
class RoutingRules:
    source: str
    workloads: Mapping[str, WorkloadRules]
    slurm: Mapping[str, SlurmTarget]

    @property
    def workload_types(self) -> tuple[str, ...]:
        return tuple(self.workloads)


def _placement(data: Mapping, where: str) -> tuple[str, str]:
    side, target = data.get("side"), check_one_of(data.get("target"), TARGET_SIDES, f"{where}.target")
    if side not in TARGET_SIDES[target]:
        sides = " or ".join(TARGET_SIDES[target])
        raise ConfigError(f"{where}.side: {side!r}; target {target} runs on {sides}")
    return side, target


def _field_rule(name: str, data: Any, where: str) -> FieldRule:
    data = check_mapping(data, where)
    if not NAME.fullmatch(str(name)) or name in SYSTEM_FIELDS:
        raise ConfigError(f"{where}: field name {name!r} must match {NAME.pattern} and not be one of "
                          f"{', '.join(SYSTEM_FIELDS)}")
    check_keys(data, where, {"type", "description"}, {"default", "minimum", "maximum", "pattern"})
    kind = check_one_of(data["type"], FIELD_TYPES, f"{where}.type")
    if kind == "integer" and not {"minimum", "maximum"} <= set(data):
        raise ConfigError(f"{where}: an integer field needs minimum and maximum")
    if kind == "string":
        try:
            re.compile(check_text(data.get("pattern"), f"{where}.pattern"))
        except re.error as exc:
            raise ConfigError(f"{where}.pattern: {data['pattern']!r} is not a regular expression: {exc}") \
                from None
    if kind != "string" and "pattern" in data:
        raise ConfigError(f"{where}.pattern: only string fields take a pattern")
    if kind != "integer" and {"minimum", "maximum"} & set(data):
        raise ConfigError(f"{where}: only integer fields take minimum and maximum")
    rule = FieldRule(name=name, type=kind, description=check_text(data["description"], f"{where}.description"),
                     default=data.get("default"), minimum=data.get("minimum"), maximum=data.get("maximum"),
                     pattern=data.get("pattern"))
    if rule.default is not None:
        try:
            rule.check(rule.default, f"{where}.default")
        except WorkloadSpecError as exc:
            raise ConfigError(str(exc)) from None
    return rule


def _condition(metric: str, data: Any, where: str) -> Condition:
    if metric not in PROFILE_METRICS:
        raise ConfigError(f"{where}: unknown profile figure {metric!r}; "
                          f"expected one of {', '.join(PROFILE_METRICS)}")
    data = check_mapping(data, where)
    if len(data) != 1:
        raise ConfigError(f"{where}: expected exactly one operator ({', '.join(OPERATORS)}), "
                          f"got {dict(data)!r}")
    ((operator, threshold),) = data.items()
    if operator not in OPERATORS:
        raise ConfigError(f"{where}: unknown operator {operator!r}; use {', '.join(OPERATORS)}")
    if isinstance(threshold, str) and ENV_REF.fullmatch(threshold):
        # ${VAR:-default}, as in pipeline.yaml: the router's realtime budget is the SLO's own variable
        threshold = from_environment(expand_env(threshold, f"{where}.{operator}"), float)
    return Condition(metric, operator, check_number(threshold, f"{where}.{operator}"))


def _rule(data: Any, where: str) -> Rule:
    data = check_mapping(data, where)
    check_keys(data, where, {"name", "why", "when", "side", "target"})
    when = check_mapping(data["when"], f"{where}.when")
    if not when:
        raise ConfigError(f"{where}.when: a rule needs at least one condition")
    side, target = _placement(data, where)
    conditions = tuple(_condition(metric, spec, f"{where}.when.{metric}") for metric, spec in when.items())
    return Rule(name=check_text(data["name"], f"{where}.name", RULE_NAME),
                why=check_text(data["why"], f"{where}.why"), side=side, target=target, conditions=conditions)


def _job(target: str, data: Any, where: str, fields_: Mapping[str, FieldRule]) -> JobTemplate:
    data = check_mapping(data, where)
    if target == "spark":
        check_keys(data, where, {"application", "args"})
        job = JobTemplate(application=check_text(data["application"], f"{where}.application", SPARK_APPLICATION),
                          args=_argv(data["args"], f"{where}.args", allow_empty=True))
    else:
        check_keys(data, where, {"command"})
        job = JobTemplate(command=_argv(data["command"], f"{where}.command", allow_empty=False))
    unknown = sorted(job.placeholders - set(fields_) - set(SYSTEM_FIELDS))
    if unknown:
        names = ", ".join(f"{{{name}}}" for name in unknown)
        raise ConfigError(f"{where}: unknown placeholder(s) {names}; use a field of the workload "
                          f"({', '.join(fields_) or 'none'}) or one of {', '.join(SYSTEM_FIELDS)}")
    return job


def _argv(data: Any, where: str, allow_empty: bool) -> tuple[str, ...]:
    strings = isinstance(data, list) and all(isinstance(arg, str) for arg in data)
    if not strings or (not data and not allow_empty):
        raise ConfigError(f"{where}: expected a list of strings (an argv, one element per argument)")
    return tuple(data)


def _needs(job: JobTemplate, fields_: Mapping[str, FieldRule]) -> set[str]:
    """Fields a variant needs from the user: those it uses that have no default."""
    return {name for name in job.placeholders if name in fields_ and fields_[name].default is None}


def _workload(name: str, data: Any, where: str) -> WorkloadRules:
    data = check_mapping(data, where)
    check_keys(data, where, {"description", "default", "rules", "fields", "jobs"}, {"preset_field"})
    side, target = _placement(check_mapping(data["default"], f"{where}.default"), f"{where}.default")
    if not isinstance(data["rules"], list):
        raise ConfigError(f"{where}.rules: expected a list")
    rules = tuple(_rule(r, f"{where}.rules[{i}]") for i, r in enumerate(data["rules"]))
    fields_ = {name: _field_rule(name, spec, f"{where}.fields.{name}")
               for name, spec in check_mapping(data["fields"], f"{where}.fields").items()}
    jobs = {}
    for job_target, variants in check_mapping(data["jobs"], f"{where}.jobs").items():
        if job_target not in TARGET_SIDES or job_target == "triton":
            raise ConfigError(f"{where}.jobs.{job_target}: expected one of spark, {', '.join(SLURM_TARGETS)} "
                              "(Triton serving is deployed by nightly_training)")
        if not isinstance(variants, list) or not variants:
            raise ConfigError(f"{where}.jobs.{job_target}: expected a non-empty list of job variants")
        jobs[job_target] = tuple(_job(job_target, v, f"{where}.jobs.{job_target}[{i}]", fields_)
                                 for i, v in enumerate(variants))
    preset_field = data.get("preset_field")
    if preset_field is not None and (preset_field not in fields_ or fields_[preset_field].type != "string"):
        raise ConfigError(f"{where}.preset_field: {preset_field!r}; name a string field of the workload "
                          f"({', '.join(n for n, f in fields_.items() if f.type == 'string') or 'none'})")
    workload = WorkloadRules(name=name, description=check_text(data["description"], f"{where}.description"),
                             default_side=side, default_target=target, rules=rules, fields=fields_, jobs=jobs,
                             preset_field=preset_field)
    for reachable in sorted(workload.targets() - {"triton"}):
        variants = jobs.get(reachable, ())
        if not any(not _needs(v, fields_) for v in variants):
            raise ConfigError(f"{where}.jobs.{reachable}: the workload can be routed to {reachable}, so it "
                              "needs a job variant whose fields all have defaults (the last resort when "
                              "config is empty)")
    return workload


def parse_routing_rules(data: Any, source: str = "routing rules") -> RoutingRules:
    """The rules from their parsed YAML/JSON; a :class:`ConfigError` names ``source`` and the key (the style of
    hybridflow.config: typed records built with its ``build``, the sections keyed by name read with its checks)."""
    try:
        check_keys(check_mapping(data, "routing"), "routing", {"targets", "workloads"})
        targets = build(SlurmTargets, data["targets"], "routing.targets")
        slurm = {name: getattr(targets, name) for name in SLURM_TARGETS}
        workloads = check_mapping(data["workloads"], "routing.workloads")
        if not workloads:
            raise ConfigError("routing.workloads: no workload types defined")
        for name in workloads:
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise ConfigError(f"routing.workloads: type name {name!r} must match {NAME.pattern}")
        return RoutingRules(source=source, slurm=slurm, workloads={
            name: _workload(name, spec, f"routing.workloads.{name}") for name, spec in workloads.items()})
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_routing_rules(path: Path | None = None) -> RoutingRules:
    path = path or include_dir() / "config" / "routing.yaml"
    return parse_routing_rules(read_yaml(path, "routing rules"), str(path))


@lru_cache(maxsize=1)
def routing_rules() -> RoutingRules:
    """The rules, loaded once per process (the router DAG calls this at parse time)."""
    return load_routing_rules()


# --- routing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """What a user asks for: the workload type, its config and, optionally, measured figures."""

    workload_type: Any
    config: Any = field(default_factory=dict)
    profile: Any = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> WorkloadSpec:
        return cls(params.get("workload_type"), params.get("config") or {}, params.get("profile") or {})


@dataclass(frozen=True)
class RouteDecision:
    """Where a workload runs and why; ``config`` holds the validated fields as argv text."""

    workload_type: str
    side: str
    target: str
    rule: str
    reason: str
    config: Mapping[str, str] = field(default_factory=dict)
    profile: Mapping[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**asdict(self), "config": dict(self.config), "profile": dict(self.profile)}


def _validated_profile(profile: Any) -> dict[str, float]:
    if not isinstance(profile, Mapping):
        raise WorkloadSpecError(f"profile: expected an object of measured figures, got {shown(profile)}")
    figures = {}
    for metric, value in profile.items():
        if metric not in PROFILE_METRICS:
            raise WorkloadSpecError(f"profile: unknown figure {shown(metric)}; "
                                    f"accepted: {', '.join(PROFILE_METRICS)}")
        is_number = not isinstance(value, bool) and isinstance(value, int | float)
        if not is_number or not math.isfinite(value) or value < 0:
            raise WorkloadSpecError(f"profile.{metric}: {shown(value)} is not a measured figure "
                                    "(a number >= 0)")
        figures[metric] = float(value)
    return figures


def _validated_config(workload: WorkloadRules, config: Any) -> dict[str, str]:
    if not isinstance(config, Mapping):
        raise WorkloadSpecError(f"config: expected an object, got {shown(config)}")
    unknown = [key for key in config if key not in workload.fields]
    if unknown:
        accepted = "; ".join(f.describe() for f in workload.fields.values()) or "none"
        raise WorkloadSpecError(f"config: {workload.name} does not accept {', '.join(map(shown, unknown))}; "
                                f"accepted: {accepted}")
    return {key: workload.fields[key].check(value, f"config.{key}") for key, value in config.items()}


@dataclass(frozen=True)
class PresetRoute:
    """The placement rule's answer for a model preset: its side, why, and config values the preset implies
    (e.g. its hidden sizes), used where the user gave none."""

    side: str
    reason: str
    config: Mapping[str, Any] = field(default_factory=dict)


def preset_router(config: PipelineConfig) -> Callable[[str], PresetRoute]:
    """The placement rule of nightly_training (the same figures, prices and ``cpus_per_task``) as a router for
    a preset named in a workload's config; an unknown preset is refused naming the valid ones."""
    from hybridflow.config import model_preset_hidden_sizes
    from hybridflow.pipeline.placement import training_placement

    presets = model_preset_hidden_sizes()

    def decide(preset: str) -> PresetRoute:
        if preset not in presets:
            raise WorkloadSpecError(f"{shown(preset)} is not a model preset; valid presets: "
                                    f"{', '.join(presets)} (include/config/model_presets.json)")
        placed = training_placement(preset, "auto", 1, placement=config.placement, costs=config.costs,
                                    cpus_per_task=config.nightly.cpus_per_task,
                                    gpu_partition=config.cluster.partition)
        return PresetRoute(placed.side, placed.reason, {"hidden_sizes": ",".join(map(str, presets[preset]))})

    return decide


def route(spec: WorkloadSpec, rules: RoutingRules,
          preset_route: Callable[[str], PresetRoute] | None = None) -> RouteDecision:
    """The side and target for ``spec``: the first rule its profile meets; else, for a workload whose config
    names a model preset (its ``preset_field``), the placement rule (``preset_route``, see
    :func:`preset_router`: slurm_cpu or slurm_gpu); else the workload's default.

    :raises WorkloadSpecError: an unknown workload type (the message lists the valid ones), a config field the
        type does not accept or a value that fails its check, a profile figure that is unknown or not a
        number, or a preset the placement rule does not know.
    """
    kind = spec.workload_type
    if not isinstance(kind, str) or kind not in rules.workloads:
        raise WorkloadSpecError(f"workload_type {shown(kind)} is not a known workload type; valid types: "
                                f"{', '.join(rules.workload_types)} (rules: {rules.source})")
    workload = rules.workloads[kind]
    config = _validated_config(workload, spec.config)
    profile = _validated_profile(spec.profile)
    for rule in workload.rules:
        if all(c.metric in profile and c.holds(profile[c.metric]) for c in rule.conditions):
            measured = " and ".join(c.describe(profile[c.metric]) for c in rule.conditions)
            return RouteDecision(kind, rule.side, rule.target, rule.name,
                                 f"{kind} -> {rule.side} ({rule.target}): measured {measured}: {rule.why}",
                                 config, profile)
    preset = config.get(workload.preset_field) if workload.preset_field else None
    if preset is not None and preset_route is not None:
        try:
            placed = preset_route(preset)
        except WorkloadSpecError as exc:
            raise WorkloadSpecError(f"config.{workload.preset_field}: {exc}") from None
        target = "slurm_gpu" if placed.side == "gpu" else "slurm_cpu"
        implied = {name: workload.fields[name].check(value, f"config.{name} (from preset {preset})")
                   for name, value in placed.config.items() if name in workload.fields and name not in config}
        why = "no measured profile given" if not profile else "the measured profile meets none of its rules"
        return RouteDecision(kind, placed.side, target, "preset-placement",
                             f"{kind} -> {placed.side} ({target}): {why}; the placement rule of nightly_training "
                             f"for preset {preset}: {placed.reason}", {**config, **implied}, profile)
    why = "no measured profile given" if not profile else "the measured profile meets none of its rules"
    return RouteDecision(kind, workload.default_side, workload.default_target, "default",
                         f"{kind} -> {workload.default_side} ({workload.default_target}): {why}; the type's "
                         f"default ({workload.description})", config, profile)


@dataclass(frozen=True)
class PlannedJob:
    """The job a decision runs: ``application`` (a file in jobs/) and ``args`` for Spark; ``command`` for
    Slurm."""

    target: str
    application: str | None = None
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()


def _fill(template: str, values: Mapping[str, str]) -> str:
    # One pass: text substituted in is never scanned again, so a value that looks like a placeholder stays
    # text.
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def plan_job(decision: RouteDecision, rules: RoutingRules,
             system: Mapping[str, Callable[[], str]]) -> PlannedJob | None:
    """The job for ``decision`` from the first variant whose fields are all given or defaulted; None for
    Triton.

    :param system: the orchestrator's values by name (see ``SYSTEM_FIELDS``); each is called only when the
        chosen variant uses it, so a variant that needs no model never looks one up.
    """
    if decision.target == "triton":
        return None
    workload = rules.workloads[decision.workload_type]
    fields_ = workload.fields
    job = next(v for v in workload.jobs[decision.target] if _needs(v, fields_) <= set(decision.config))
    values = {}
    for name in sorted(job.placeholders):
        if name in decision.config:
            values[name] = decision.config[name]
        elif name in fields_:
            values[name] = str(fields_[name].default)  # checked when the rules were loaded
        else:
            values[name] = str(system[name]())
    return PlannedJob(target=decision.target, application=job.application,
                      args=tuple(_fill(a, values) for a in job.args),
                      command=tuple(_fill(a, values) for a in job.command))


SERVER_SIDE = {"python": "cpu", "pytorch_libtorch": "gpu"}  # where Triton runs a backend's model instances


def triton_deploy_plan(decision: RouteDecision, model: Mapping[str, Any], serving: Any) -> dict[str, Any]:
    """What a realtime workload routed to Triton does: deploy the model of record through the deploy operator.

    :param model: the model of record (``version``, ``export_dir``), as
        ``hybridflow.pipeline.nightly_tasks.model_of_record`` returns it.
    :param serving: the pipeline config's ``serving`` section (model name, repository, backend, the gate).
    :returns: ``export_dir`` for the operator and ``summary``, the sentence a dry run prints.
    """
    server_side = SERVER_SIDE[serving.backend]
    summary = (f"deploy the model of record {model['version']} ({model['export_dir']}) to Triton model "
               f"{serving.model_name!r} in {serving.repository} (backend {serving.backend}: {server_side} "
               "instances): publish it as a new version, or reuse the version holding the same model.pt; load it "
               f"beside the serving version; smoke test; latency gate p99 <= {number(serving.slo_p99_ms)} ms over "
               f"{serving.gate_requests} requests, {serving.gate_concurrency} in flight; promote it or roll back")
    if server_side != decision.side:
        summary += (f". Note: routed to the {decision.side} side, but this estate's Triton serves on "
                    f"{server_side} (serving.backend: {serving.backend}); set serving.backend to "
                    f"{next(b for b, s in SERVER_SIDE.items() if s == decision.side)} for {decision.side} "
                    "servers")
    return {"export_dir": model["export_dir"], "model_version": model["version"], "model_name": serving.model_name,
            "backend": serving.backend, "server_side": server_side, "summary": summary}
