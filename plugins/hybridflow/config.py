"""Typed pipeline configuration from include/config/pipeline.yaml, validated when it is loaded, and the one way
every config file of the package is validated (pipeline.yaml here, routing.yaml in pipeline/routing.py, the
features contract in pipeline/quality.py).

The style: each section is a frozen dataclass whose defaults are the defaults (operators take theirs from it);
:func:`build` makes one from a mapping (unknown, missing and mistyped keys are errors) and calls its
``validate(where)``; what build cannot express (mappings keyed by name, lists) is read with the ``check_*``
functions (mapping, keys, text, integer, number, one_of). Every error reads
``<file>: <where>.<key>: <value found>; <what to do>``, so a mistake fails at parse time rather than in the
middle of a run.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

from hybridflow.exceptions import ConfigError
from hybridflow.layout import StorageLayout
from hybridflow.paths import include_dir
from hybridflow.utils.mlflow_tracking import validate_experiment_name
from hybridflow.utils.release import StepThresholds, canary_steps
from hybridflow.utils.stalls import STALL_SETTINGS

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# ZeRO stages with a DeepSpeed config in include/deepspeed/zero<stage>.json.
ZERO_STAGES = (0, 1, 2, 3)  # include/deepspeed/zero<N>.json; 0: plain data parallelism, for one node
ENV_REF = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?::-(?P<default>[^}]*))?\}")
# What a training run may ask for (nightly_training's param `device`): auto decides by the measured figures of
# `placement` (hybridflow.pipeline.placement); gpu and cpu win over them.
DEVICES = ("auto", "gpu", "cpu")
# nightly_training's param `deploy`; ask: as auto, then a person approves the promotion
DEPLOY_MODES = ("auto", "always", "never", "ask")
SLURM_PARTITION = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ClusterConfig:
    ssh_conn_id: str
    partition: str
    python: str
    jobs_dir: str
    max_requeues: int = 3
    poll_interval_s: float = 10.0
    # How long a wait in the triggerer (a job, capacity, a checkpoint) rides out an unreachable login node before
    # it gives up; the job runs on either way.
    reconnect_budget_s: float = 300.0


@dataclass(frozen=True)
class StorageConfig:
    # A local path every side mounts, or s3://bucket/prefix (any S3-compatible store) read through conn_id.
    root: str
    # The Amazon provider's `aws` connection for an s3:// root (keys, role, profile, endpoint_url in its extra).
    conn_id: str = "storage_s3"

    def validate(self, where: str) -> None:
        if self.root.startswith("s3://"):
            bucket = self.root.removeprefix("s3://").split("/", 1)[0]
            if not bucket:
                raise ConfigError(f"{where}.root: {self.root!r} names no bucket; expected s3://bucket/prefix")
        elif "://" in self.root or not self.root.startswith("/"):
            raise ConfigError(f"{where}.root: {self.root!r}; expected an absolute path or s3://bucket/prefix")
        if not self.conn_id:
            raise ConfigError(f"{where}.conn_id: empty; name the `aws` connection of the s3:// storage root")

    @property
    def layout(self) -> StorageLayout:
        """Every path under ``root`` (hybridflow/layout.py): no caller writes one by hand."""
        return StorageLayout(self.root)


@dataclass(frozen=True)
class PreflightConfig:
    schedule: str
    max_allreduce_share: float = 0.2
    max_age_days: int = 8
    # The topology the scheduled preflight measures: nodes x ranks (one per GPU) per node. A preflight clears
    # only a training run of the same topology.
    nodes: int = 1
    ranks_per_node: int = 2
    time_limit_min: int = 15

    def validate(self, where: str) -> None:
        if not 0 < self.max_allreduce_share < 1:
            raise ConfigError(f"{where}.max_allreduce_share: {self.max_allreduce_share} is not between 0 and 1")
        for key in ("nodes", "ranks_per_node", "max_age_days", "time_limit_min"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)}; expected a positive integer")
        if self.nodes * self.ranks_per_node < 2:
            raise ConfigError(f"{where}: nodes x ranks_per_node = {self.nodes * self.ranks_per_node}; an all-reduce "
                              "needs at least 2 ranks (raise ranks_per_node or nodes)")


@dataclass(frozen=True)
class SparkConfig:
    conn_id: str = "spark_default"
    driver_memory: str = "1g"
    # Cores a Spark stage holds, for CPU-hour accounting in the run report.
    executor_cores: int = 2
    lookback_days: int = 28

    def validate(self, where: str) -> None:
        if self.executor_cores < 1:
            raise ConfigError(f"{where}.executor_cores: {self.executor_cores}; expected a positive integer")
        if not re.fullmatch(r"[1-9][0-9]*[mg]", self.driver_memory):
            raise ConfigError(f"{where}.driver_memory: {self.driver_memory!r}; expected a size such as 1g or 512m")


@dataclass(frozen=True)
class NightlyConfig:
    """The nightly training pipeline: schedule, training defaults and the champion/challenger rule."""

    schedule: str
    model_name: str = "propensity"
    # Raw events are produced upstream; the local stack simulates them (the generator) when this is true.
    simulate_raw: bool = False
    simulate_raw_rows: int = 50_000
    raw_wait_timeout_min: int = 60
    train_window_days: int = 7
    model_preset: str = "small"
    epochs: int = 2
    max_steps: int = 2000
    batch_size: int = 256
    learning_rate: float = 0.002
    checkpoint_every_steps: int = 100
    # Data-parallel training: `nodes` nodes x `gpus_per_node` GPUs per node, one rank per GPU.
    nodes: int = 1
    gpus_per_node: int = 1
    # DeepSpeed: ZeRO stage (include/deepspeed/zero<stage>.json) and micro-batches per optimizer step; the global
    # batch is batch_size x gradient_accumulation_steps x nodes x gpus_per_node. zero_stage None (null): by the
    # run's topology, zero_stage_one_node or zero_stage_several_nodes (pipeline/nightly.py zero_stage_for).
    zero_stage: int | None = None
    zero_stage_one_node: int = 0
    zero_stage_several_nodes: int = 1
    gradient_accumulation_steps: int = 1
    cpus_per_task: int = 2
    torch_threads: int = 1
    time_limit_min: int = 60
    # A challenger replaces the champion only when its holdout AUC is higher by at least this much.
    min_auc_gain: float = 0.002
    min_gpu_utilization_pct: float = 40.0
    fail_on_low_utilization: bool = False
    max_active_runs: int = 3
    # CPU or GPU for training: auto (the placement rule), gpu or cpu; the param `device` of nightly_training.
    device: str = "auto"
    # The default of the param `deploy` (scheduled runs take it): auto, ask (a person approves each promotion),
    # always or never.
    deploy: str = "auto"
    # The MLflow experiment each training task is a run of (stored verbatim).
    mlflow_experiment: str = "nightly_training"
    # A run not done this many minutes after it was queued alerts on-call with the stage it is in.
    deadline_min: float = 240.0

    @property
    def cron(self) -> str | None:
        """The DAG's schedule: None when the schedule is "none" (triggered on demand only)."""
        return None if self.schedule.strip().lower() in ("", "none") else self.schedule

    def validate(self, where: str) -> None:
        if not MODEL_NAME.fullmatch(self.model_name):
            raise ConfigError(f"{where}.model_name: {self.model_name!r}; use letters, digits, '_', '-' (1-64)")
        for key in ("simulate_raw_rows", "raw_wait_timeout_min", "train_window_days", "epochs", "max_steps",
                    "batch_size", "checkpoint_every_steps", "nodes", "gpus_per_node", "gradient_accumulation_steps",
                    "cpus_per_task", "torch_threads", "time_limit_min", "max_active_runs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)}; expected a positive integer")
        stages = ", ".join(map(str, ZERO_STAGES))
        for key in ("zero_stage", "zero_stage_one_node", "zero_stage_several_nodes"):
            value = getattr(self, key)
            if not (value is None and key == "zero_stage") and value not in ZERO_STAGES:
                by_topology = " or null (by the run's topology)" if key == "zero_stage" else ""
                raise ConfigError(f"{where}.{key}: {value}; choose one of {stages}{by_topology}")
        if not 0 <= self.min_auc_gain < 1:
            raise ConfigError(f"{where}.min_auc_gain: {self.min_auc_gain}; expected a value in [0, 1)")
        if not self.learning_rate > 0:
            raise ConfigError(f"{where}.learning_rate: {self.learning_rate}; expected a positive number")
        if not 0 < self.deadline_min < math.inf:
            raise ConfigError(f"{where}.deadline_min: {self.deadline_min}; expected minutes > 0 (a run not done "
                              "this long after it was queued alerts on-call)")
        if self.device not in DEVICES:
            raise ConfigError(f"{where}.device: {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.deploy not in DEPLOY_MODES:
            raise ConfigError(f"{where}.deploy: {self.deploy!r}; choose one of {', '.join(DEPLOY_MODES)}")
        try:
            validate_experiment_name(self.mlflow_experiment, f"{where}.mlflow_experiment")
        except ValueError as error:
            raise ConfigError(str(error)) from None


@dataclass(frozen=True)
class CostConfig:
    """Prices for the run report's cost figures (USD per hour): one GPU, one CPU core, one inference server.
    Checked when built, so a report is never priced with a negative or non-finite number."""

    gpu_hour_usd: float = 4.0
    cpu_hour_usd: float = 0.05
    serving_hour_usd: float = 1.2

    def __post_init__(self) -> None:
        self.validate("costs")

    def validate(self, where: str) -> None:
        for key in ("gpu_hour_usd", "cpu_hour_usd", "serving_hour_usd"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{where}.{key}: expected a finite number of USD, got {value!r}")
            if value < 0:
                raise ConfigError(f"{where}.{key}: {value}; a price cannot be negative")


RELEASE_STRATEGIES = ("progressive", "direct")
NO_TRAFFIC_POLICIES = ("wait", "promote", "fail")


@dataclass(frozen=True)
class ReleaseConfig(StepThresholds):
    """How a new version meets real traffic once it passed the smoke set and the latency gate.

    ``progressive``: the guard copies unversioned requests to it (shadow, ``shadow_s``; 0 skips it), then sends it
    each ``canary_steps`` share in turn; every step lasts at least ``step_min_s`` and is judged against the stable
    version on the same window by :func:`hybridflow.utils.release.judge` (errors by count, latency ratios and the
    SLO by distribution-free bounds at ``confidence``, mean score shift and PSI); the last step, 100, is the
    promotion. ``direct``: promote after the gates (no real traffic first).
    ``no_traffic``: when a step sees too few requests within ``step_timeout_s``: ``fail`` (roll back),
    ``promote`` (on the gates alone, said in the log and the report) or ``wait`` (no time limit but the task's).
    ``approval_timeout_s``: with approval asked (``deploy=ask``), how long the release waits at its last canary
    step for a human; then it is rolled back (nobody approved it).
    """

    strategy: str = "progressive"
    shadow_s: float = 60.0
    canary_steps: tuple[int, ...] = (10, 50, 100)
    step_min_s: float = 60.0
    step_timeout_s: float = 900.0
    no_traffic: str = "fail"
    approval_timeout_s: float = 4 * 3600.0

    def thresholds(self) -> StepThresholds:
        """What the step trigger judges with (its arguments must stay plain)."""
        return StepThresholds(**{f.name: getattr(self, f.name) for f in fields(StepThresholds)})

    def validate(self, where: str) -> None:
        if self.strategy not in RELEASE_STRATEGIES:
            raise ConfigError(f"{where}.strategy: {self.strategy!r}; choose {' or '.join(RELEASE_STRATEGIES)}")
        if self.no_traffic not in NO_TRAFFIC_POLICIES:
            raise ConfigError(f"{where}.no_traffic: {self.no_traffic!r}; choose one of "
                              f"{', '.join(NO_TRAFFIC_POLICIES)}")
        canary_steps(self.canary_steps, f"{where}.canary_steps")
        for key in ("shadow_s", "step_min_s", "step_timeout_s", "approval_timeout_s"):
            value, positive = getattr(self, key), key in ("step_timeout_s", "approval_timeout_s")
            if not 0 <= value < math.inf or (positive and value <= 0):
                raise ConfigError(f"{where}.{key}: {value}; expected seconds {'> 0' if positive else '>= 0'}")
        if self.step_min_s > self.step_timeout_s:
            raise ConfigError(f"{where}.step_min_s: {self.step_min_s} is over step_timeout_s {self.step_timeout_s}; "
                              "a step could never pass")
        super().validate(where)


@dataclass(frozen=True)
class ServingConfig:
    """The realtime model on Triton and the gate a new version passes before it is promoted."""

    model_name: str
    repository: str
    triton_conn_id: str = "triton_default"
    storage_conn_id: str = "storage_s3"
    backend: str = "python"
    instance_count: int = 1
    max_batch_size: int = 256
    max_queue_delay_us: int = 0
    slo_p99_ms: float = 50.0
    gate_concurrency: int = 4
    gate_requests: int = 400
    gate_warmup_requests: int = 20
    readiness_timeout_s: float = 300.0
    release: ReleaseConfig = field(default_factory=ReleaseConfig)

    def validate(self, where: str) -> None:
        from hybridflow.utils.triton import BACKENDS, MODEL_NAME_RE, Repository

        if not MODEL_NAME_RE.fullmatch(self.model_name):
            raise ConfigError(f"{where}.model_name: {self.model_name!r}; use letters, digits, '_', '.', '-'")
        try:
            Repository.parse(self.repository)
        except ConfigError as exc:
            raise ConfigError(f"{where}.repository: {exc}") from None
        if self.backend not in BACKENDS:
            raise ConfigError(f"{where}.backend: {self.backend!r}; choose {' or '.join(BACKENDS)} "
                              "(python on CPU servers, pytorch_libtorch on GPU servers)")
        for key in ("instance_count", "max_batch_size", "gate_concurrency", "gate_requests"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)}; expected a positive integer")
        # Beside the serving version, the gate bounds each percentile's ratio (utils/release.py judge_gate).
        needed = max(self.release.samples_needed().values())
        if self.gate_warmup_requests < 0 or self.gate_requests - self.gate_warmup_requests < needed:
            raise ConfigError(f"{where}.gate_requests: {self.gate_requests} with gate_warmup_requests "
                              f"{self.gate_warmup_requests}; the gate's percentiles need {needed} measured requests "
                              f"for their {self.release.confidence:.0%} bounds: give gate_requests >= "
                              f"{needed + max(self.gate_warmup_requests, 0)}")
        if self.max_queue_delay_us < 0:
            raise ConfigError(f"{where}.max_queue_delay_us: {self.max_queue_delay_us}; expected >= 0")
        for key in ("slo_p99_ms", "readiness_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)}; expected a positive number")


FAILURE_ACTIONS = ("requeue", "retry", "fail", "exclude_node")
_SLURM_STATE = re.compile(r"[A-Z][A-Z_]*")
_RUNBOOK_REF = re.compile(r"[a-z0-9_-]+\.md#[a-z0-9-]+")


@dataclass(frozen=True)
class FailureClass:
    """One row of the failure-class table: what a Slurm job ended with, and what the operator does about it.

    Every criterion given must match: the job's state (one of ``states``), exit code, signal, and
    ``log_pattern`` (a regular expression searched in the last lines of the job's log). ``action``: ``requeue``
    (the same job again, resuming from its checkpoint; up to the cluster's ``max_requeues``), ``retry`` (the task
    fails and Airflow's retries submit a new job), ``fail`` (the task fails at once, no retry: retrying cannot
    help), ``exclude_node`` (the job's node failed its self-check: submit once more without that node).
    ``runbook``: ``<file>.md#<section>`` under include/runbooks.
    """

    action: str
    runbook: str
    states: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = ()
    signals: tuple[int, ...] = ()
    log_pattern: str = ""

    def validate(self, where: str) -> None:
        check_one_of(self.action, FAILURE_ACTIONS, f"{where}.action")
        check_text(self.runbook, f"{where}.runbook", _RUNBOOK_REF)
        if not (include_dir() / "runbooks" / self.runbook.split("#")[0]).is_file():
            raise ConfigError(f"{where}.runbook: {self.runbook!r}; no such file under include/runbooks")
        for index, state in enumerate(self.states):
            check_text(state, f"{where}.states[{index}]", _SLURM_STATE)
        for name in ("exit_codes", "signals"):
            for index, value in enumerate(getattr(self, name)):
                check_integer(value, f"{where}.{name}[{index}]", 0)
        if self.log_pattern:
            try:
                re.compile(self.log_pattern)
            except re.error as exc:
                raise ConfigError(f"{where}.log_pattern: {self.log_pattern!r} is not a regular expression: "
                                  f"{exc}") from None
        if not (self.states or self.exit_codes or self.signals or self.log_pattern):
            raise ConfigError(f"{where}: matches nothing; give states, exit_codes, signals or log_pattern")


@dataclass(frozen=True)
class RecoveryConfig:
    """How Slurm jobs heal: the stall watch (training ranks' heartbeats; the deadlines are
    :class:`~hybridflow.utils.stalls.StallWatch`'s) and the failure-class table, in order (the first class that
    matches a job's end decides)."""

    stall_timeout_s: float = 900.0
    stall_floor_s: float = 30.0
    stall_factor: float = 10.0
    stall_warm_up_steps: int = 5
    max_stall_restarts: int = 2
    failure_classes: Mapping[str, FailureClass] = field(default_factory=dict)
    log_lines: int = 200  # the job log's last lines searched for a class's log_pattern
    # the node self-check before training ranks start (jobs/node_check.py)
    node_check: bool = True
    node_min_free_gib: float = 1.0
    node_scratch_dir: str = ""  # node-local scratch to check ("%n": the node's name); "" checks none

    def validate(self, where: str) -> None:
        check_number(self.node_min_free_gib, f"{where}.node_min_free_gib", 0)
        if self.node_scratch_dir and not self.node_scratch_dir.startswith("/"):
            raise ConfigError(f"{where}.node_scratch_dir: {self.node_scratch_dir!r}; expected an absolute path or ''")
        for key, (low, high) in STALL_SETTINGS.items():
            check = check_integer if key == "stall_warm_up_steps" else check_number
            if check(getattr(self, key), f"{where}.{key}", low) > high:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)!r}; expected a number <= {high:g}")
        check_integer(self.max_stall_restarts, f"{where}.max_stall_restarts", 0)
        check_integer(self.log_lines, f"{where}.log_lines", 1)


@dataclass(frozen=True)
class AlertsConfig:
    """Where on-call alerts go: always the local sink (a JSON-lines file); also a webhook connection if named."""

    sink_conn_id: str = ""
    dedup_window_s: float = 3600.0
    log_lines: int = 40

    def validate(self, where: str) -> None:
        if self.dedup_window_s < 0:
            raise ConfigError(f"{where}.dedup_window_s: {self.dedup_window_s}; expected seconds >= 0")
        if self.log_lines < 1:
            raise ConfigError(f"{where}.log_lines: {self.log_lines}; expected a positive integer")


@dataclass(frozen=True)
class ReconcilerConfig:
    """The Slurm orphan reconciler: when it runs, and how old a job whose task is not live must be to be cancelled
    (by its submit time, on the cluster's clock)."""

    schedule: str = "*/5 * * * *"
    grace_s: int = 300
    deployment: str = "default"  # utils.slurm_jobs.DEFAULT_DEPLOYMENT

    def validate(self, where: str) -> None:
        from hybridflow.utils.reconcile import MAX_GRACE_S

        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.deployment):
            raise ConfigError(f"{where}.deployment: {self.deployment!r}; expected 1-64 letters, digits, '_', '.', '-'")
        if not 0 <= self.grace_s <= MAX_GRACE_S:
            raise ConfigError(f"{where}.grace_s: {self.grace_s}; expected seconds from 0 to {MAX_GRACE_S}")


@dataclass(frozen=True)
class UtilizationConfig:
    """The GPU partition ledger (dags/cluster_utilization.py): which partitions, when it runs, the utilization the
    platform aims at, and after how many days under it on-call hears. Days are the cluster's calendar days (sacct
    reads times in the login node's local time)."""

    partitions: tuple[str, ...] = ("gpu-training",)
    schedule: str = "30 0 * * *"
    target: float = 0.6  # allocated / available GPU-hours
    alert_days: int = 3

    def validate(self, where: str) -> None:
        if not self.partitions:
            raise ConfigError(f"{where}.partitions: empty; expected at least one Slurm partition")
        for index, partition in enumerate(self.partitions):
            check_text(partition, f"{where}.partitions[{index}]", SLURM_PARTITION)
        check_text(self.schedule, f"{where}.schedule")
        if not 0 < check_number(self.target, f"{where}.target", 0) <= 1:
            raise ConfigError(f"{where}.target: {self.target}; expected a share of available GPU-hours in (0, 1]")
        check_integer(self.alert_days, f"{where}.alert_days", 1)


def _positive_or_null(value: float | None, where: str, what: str) -> None:
    """A measured figure: a positive finite number, or None (not measured)."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise ConfigError(f"{where}: {value}; expected a positive number of {what}, or null (not measured)")


@dataclass(frozen=True)
class MeasuredRate:
    """One measured training throughput: rows per second of one rank (one GPU, or one CPU process holding
    ``nightly.cpus_per_task`` cores), and where and when it was measured. ``rows_per_s: null`` is "not
    measured", and ``measured`` then says so; a figure is never estimated into this file."""

    rows_per_s: float | None
    measured: str

    def validate(self, where: str) -> None:
        _positive_or_null(self.rows_per_s, f"{where}.rows_per_s", "rows per second")
        check_text(self.measured, f"{where}.measured")


@dataclass(frozen=True)
class PresetRates:
    """A preset's measured training throughput on each side."""

    cpu: MeasuredRate
    gpu: MeasuredRate


@dataclass(frozen=True)
class EvaluationPlacementConfig:
    """Where the champion/challenger evaluation runs. Its scoring work is (challenger + champion parameters) x
    holdout rows ("parameter-rows"); at the measured CPU rate, a job estimated over ``max_cpu_s`` runs on the GPU
    partition with ``gpus`` GPU(s), else on the CPU partition. Rates are measured figures (null: not measured,
    and the evaluation stays on the CPU partition)."""

    max_cpu_s: float = 30.0
    cpu_parameter_rows_per_s: float | None = None
    gpu_parameter_rows_per_s: float | None = None
    measured: str = "not measured"
    # the holdout share of the window's rows (jobs/evaluate.py --holdout-fraction, whose default it is)
    holdout_fraction: float = 0.2
    gpus: int = 1

    def validate(self, where: str) -> None:
        if not math.isfinite(self.max_cpu_s) or self.max_cpu_s <= 0:
            raise ConfigError(f"{where}.max_cpu_s: {self.max_cpu_s}; expected a positive number of seconds")
        for key in ("cpu_parameter_rows_per_s", "gpu_parameter_rows_per_s"):
            _positive_or_null(getattr(self, key), f"{where}.{key}", "parameter-rows per second")
        check_text(self.measured, f"{where}.measured")
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError(f"{where}.holdout_fraction: {self.holdout_fraction}; expected a value in (0, 1)")
        if not 1 <= self.gpus <= 8:
            raise ConfigError(f"{where}.gpus: {self.gpus}; expected 1 to 8 GPUs")


@dataclass(frozen=True)
class PlacementConfig:
    """CPU or GPU for training and evaluation, from measured figures (hybridflow.pipeline.placement). The GPU
    partition is ``cluster.partition``; without figures for a preset a run keeps the GPU (the default)."""

    cpu_partition: str = "cpu"
    # device=auto takes the GPU when it is at least this many times faster per rank, whatever it costs; below
    # that the side with the lower cost per 1,000 rows wins.
    min_gpu_speedup: float = 10.0
    training: Mapping[str, PresetRates] = field(default_factory=dict)
    evaluation: EvaluationPlacementConfig = field(default_factory=EvaluationPlacementConfig)

    def validate(self, where: str) -> None:
        check_text(self.cpu_partition, f"{where}.cpu_partition", SLURM_PARTITION)
        if not math.isfinite(self.min_gpu_speedup) or self.min_gpu_speedup < 1:
            raise ConfigError(f"{where}.min_gpu_speedup: {self.min_gpu_speedup}; expected a number >= 1 (how many "
                              "times faster a GPU rank must be to win whatever it costs)")
        presets = model_preset_names()
        unknown = sorted(set(self.training) - set(presets))
        if unknown:
            raise ConfigError(f"{where}.training.{unknown[0]}: not a model preset; expected one of "
                              f"{', '.join(presets)} (include/config/model_presets.json)")


@dataclass(frozen=True)
class PipelineConfig:
    cluster: ClusterConfig
    storage: StorageConfig
    preflight: PreflightConfig
    serving: ServingConfig
    spark: SparkConfig
    nightly: NightlyConfig
    costs: CostConfig
    alerts: AlertsConfig
    reconciler: ReconcilerConfig
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    utilization: UtilizationConfig = field(default_factory=UtilizationConfig)
    # absent: no figures, so every run keeps the GPU (what the suite did before placement existed)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def expand_env(value: str, where: str) -> str:
    def replace(match: re.Match) -> str:
        name, default = match.group("name"), match.group("default")
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{where}: environment variable {name} is not set and has no default")
        return default

    return ENV_REF.sub(replace, value)


def from_environment(value: str, expected: type) -> Any:
    """An environment value is text: read it as the bool or number the key expects (else leave it to fail)."""
    if expected is bool and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if expected in (int, float):
        try:
            return expected(value)
        except ValueError:
            return value
    return value


def _optional(expected: Any) -> tuple[Any, bool]:
    """``(X, True)`` for a hint ``X | None``, else ``(expected, False)``."""
    args = get_args(expected) if isinstance(expected, UnionType) else ()
    if len(args) == 2 and type(None) in args:
        return next(arg for arg in args if arg is not type(None)), True
    return expected, False


def build(cls: type, data: Any, where: str):
    """A dataclass from a mapping: unknown keys, missing keys and wrong types are errors naming the key; then the
    dataclass's own ``validate(where)``, if it has one. A field typed as a dataclass is built the same way; one
    typed ``Mapping[str, <dataclass>]`` is a mapping keyed by name whose values are built so; one typed
    ``X | None`` also takes null."""
    check_keys(check_mapping(data, where), where, optional=[f.name for f in fields(cls)])
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        key = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key}: missing (expected {getattr(hints[f.name], '__name__', hints[f.name])})")
            continue
        (expected, optional), value = _optional(hints[f.name]), data[f.name]
        if optional and value is None:
            values[f.name] = None
            continue
        if isinstance(expected, type) and is_dataclass(expected):
            values[f.name] = build(expected, value, key)
            continue
        if get_origin(expected) is Mapping:
            values[f.name] = _build_keyed(get_args(expected)[1], value, key)
            continue
        if get_origin(expected) is tuple:  # a YAML list; the dataclass's validate checks its items
            if not isinstance(value, list | tuple):
                raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
            values[f.name] = tuple(value)
            continue
        if isinstance(value, str) and ENV_REF.search(value):
            value = from_environment(expand_env(value, key), expected)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
        values[f.name] = value
    obj = cls(**values)
    if hasattr(obj, "validate"):
        obj.validate(where)
    return obj


def _build_keyed(cls: type, data: Any, where: str) -> dict[str, Any]:
    built = {}
    for name, value in check_mapping(data, where).items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: key {name!r}; expected a name")
        built[name] = build(cls, value, f"{where}.{name}")
    return built


# Checks for config read without build (mappings keyed by name, lists): the same "<where>: <value>; <fix>" shape.
# Each returns the value it checked.


def check_mapping(data: Any, where: str) -> Mapping[str, Any]:
    """``data`` when it is a mapping (a YAML or JSON object)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    return data


def check_keys(data: Mapping, where: str, required: Iterable[str] = (), optional: Iterable[str] = ()) -> None:
    """``data`` has every ``required`` key and no key beyond ``required`` and ``optional`` (a misspelt key would
    otherwise fall back to its default unnoticed)."""
    required = set(required)
    known = required | set(optional)
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    missing = sorted(required - set(data))
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: missing (required)")


def check_text(value: Any, where: str, pattern: re.Pattern | None = None) -> str:
    """Non-empty text, matching ``pattern`` when given."""
    if not isinstance(value, str) or not value.strip() or (pattern and not pattern.fullmatch(value)):
        expected = f"text matching {pattern.pattern}" if pattern else "non-empty text"
        raise ConfigError(f"{where}: {value!r}; expected {expected}")
    return value


def check_integer(value: Any, where: str, minimum: int) -> int:
    """An integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {value!r}; expected an integer >= {minimum}")
    return value


def check_number(value: Any, where: str, minimum: float | None = None, finite: bool = True) -> float:
    """A number (not a bool, not NaN; finite unless ``finite`` is false) of at least ``minimum`` when given."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or (finite and not math.isfinite(value)) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ConfigError(f"{where}: {value!r}; expected a number{bound}")
    return float(value)


def check_one_of(value: Any, choices: Iterable[Any], where: str) -> Any:
    """``value`` when it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{where}: {value!r}; expected one of {', '.join(map(str, choices))}")
    return value


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's data; a file that cannot be read or parsed is a ConfigError naming it and ``what`` it is."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc}") from exc


def load_pipeline_config(path: Path | None = None) -> PipelineConfig:
    path = path or include_dir() / "config" / "pipeline.yaml"
    data = read_yaml(path, "pipeline config")
    try:
        return build(PipelineConfig, data, "pipeline")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


@lru_cache(maxsize=1)
def pipeline_config() -> PipelineConfig:
    """The configuration, loaded once per process (DAG files call this at parse time)."""
    return load_pipeline_config()


def _model_presets(path: Path | None) -> tuple[Path, Mapping[str, Any]]:
    path = path or include_dir() / "config" / "model_presets.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the model presets: {exc}") from exc
    try:
        presets = check_mapping(check_mapping(data, "model presets").get("presets"), "presets")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not presets:
        raise ConfigError(f"{path}: presets: {{}}; define at least one preset")
    return path, presets


def model_preset_names(path: Path | None = None) -> tuple[str, ...]:
    """The presets of include/config/model_presets.json, in the file's order: the one list of them on this side
    (the nightly DAG's choices, the training task's check). jobs/hybridtrain/config.py reads the same file, shipped
    with the jobs, for the network each one is."""
    return tuple(_model_presets(path)[1])


def model_preset_hidden_sizes(path: Path | None = None) -> dict[str, tuple[int, ...]]:
    """Each preset's hidden layer widths (the placement rule counts a network's parameters from them)."""
    path, presets = _model_presets(path)
    sizes = {}
    for name, preset in presets.items():
        widths = preset.get("hidden_sizes") if isinstance(preset, Mapping) else None
        if not isinstance(widths, list) or not widths or not all(
                isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths):
            raise ConfigError(f"{path}: presets.{name}.hidden_sizes: {widths!r}; expected a list of positive "
                              "integers")
        sizes[name] = tuple(widths)
    return sizes
