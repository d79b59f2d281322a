"""Release a model version to a Triton server safely (publish, load beside the serving one, readiness, smoke test,
latency gate, promote or roll back), and the on-call rollback to the previously promoted version."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink, conf

from hybridflow.config import ReleaseConfig, ServingConfig
from hybridflow.exceptions import ConfigError, ModelRolledBack, TritonError
from hybridflow.utils.release import FAIL, HOLD, Verdict, judge_gate

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

    from hybridflow.hooks.model_repository import ModelRepository
    from hybridflow.hooks.triton import TritonHook
    from hybridflow.triggers.triton import TritonModelReadyTrigger
    from hybridflow.utils.triton import SmokeResult, SmokeSet, VersionRecord

XCOM_REPORT = "deploy_report"
APPROVALS = ("auto", "ask")
DEFAULT_RUNBOOK = "include/runbooks/deploy.md"


def serving_kwargs(serving: ServingConfig) -> dict[str, Any]:
    """The operators' arguments from the pipeline config's ``serving:`` section."""
    return {
        "model_name": serving.model_name, "triton_conn_id": serving.triton_conn_id,
        "repository": serving.repository, "storage_conn_id": serving.storage_conn_id, "backend": serving.backend,
        "instance_count": serving.instance_count, "max_batch_size": serving.max_batch_size,
        "max_queue_delay_us": serving.max_queue_delay_us, "readiness_timeout_s": serving.readiness_timeout_s,
    }


def deploy_kwargs(serving: ServingConfig) -> dict[str, Any]:
    """:class:`TritonDeployOperator`'s arguments from the ``serving:`` section, the gate included."""
    return {**serving_kwargs(serving), "slo_p99_ms": serving.slo_p99_ms, "concurrency": serving.gate_concurrency,
            "gate_requests": serving.gate_requests, "gate_warmup_requests": serving.gate_warmup_requests,
            "release": serving.release}


def run_sync(coro):
    """Run a coroutine to completion from task code, even where an event loop already runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def final(error: Exception) -> Exception:
    """The same error as one Airflow does not retry: retrying cannot change a corrupt file or a wrong output."""
    from airflow.sdk.exceptions import AirflowFailException

    failure = AirflowFailException(str(error))
    failure.__cause__ = error
    return failure


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def version_number(value: int | str | None, name: str, hint: str) -> int:
    """A version number from an argument that may be rendered template text; empty is 0."""
    text = str(value).strip() if value not in (None, "") else "0"
    if not text.isdigit():
        raise ConfigError(f"{name} {value!r}: give {hint}")
    return int(text)


def awaiting_approval(report: dict | None) -> bool:
    """Whether a deploy report holds a release for a person (``approval: ask``)."""
    return bool(((report or {}).get("release") or {}).get("awaiting_approval"))


def step_label(mode: str, share: int) -> str:
    return "shadow" if mode == "shadow" else f"canary {share}%"


class TritonModelStatusLink(BaseOperatorLink):
    """The server's status page of the version the task deployed or restored."""

    name = "Model status"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return getattr(operator, "status_url", "") or ""


class TritonServingOperator(BaseOperator):
    """What deploy and rollback share: the server, the repository, the served config, loads and the smoke test.

    :param model_name: the served model's name (templated).
    :param triton_conn_id: connection of type ``triton`` (model control goes over its gRPC port).
    :param repository: the model repository the server reads: a local directory or ``s3://bucket/prefix``
        (templated).
    :param storage_conn_id: the S3 connection when ``repository`` is on S3.
    :param backend: ``python`` (CPU servers) or ``pytorch_libtorch`` (KIND_GPU servers); same tensors either way.
    :param instance_count: model instances per version; ``max_batch_size`` and ``max_queue_delay_us`` configure
        dynamic batching.
    :param readiness_timeout_s: how long a load may take before the version counts as failed.

    Defaults are the pipeline config's (:class:`~hybridflow.config.ServingConfig`); :func:`serving_kwargs` passes
    the configured values.
    """

    template_fields: Sequence[str] = ("model_name", "repository")
    operator_extra_links = (TritonModelStatusLink(),)
    ui_color = "#e8f5d9"

    def __init__(
        self,
        *,
        model_name: str,
        repository: str,
        triton_conn_id: str = ServingConfig.triton_conn_id,
        storage_conn_id: str = ServingConfig.storage_conn_id,
        backend: str = ServingConfig.backend,
        instance_count: int = ServingConfig.instance_count,
        max_batch_size: int = ServingConfig.max_batch_size,
        max_queue_delay_us: int | None = ServingConfig.max_queue_delay_us,
        torch_threads: int = 1,
        readiness_timeout_s: float = ServingConfig.readiness_timeout_s,
        poll_interval_s: float = 1.0,
        runbook: str = DEFAULT_RUNBOOK,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.model_name = model_name
        self.repository = repository
        self.triton_conn_id = triton_conn_id
        self.storage_conn_id = storage_conn_id
        self.backend = backend
        self.instance_count = instance_count
        self.max_batch_size = max_batch_size
        self.max_queue_delay_us = max_queue_delay_us
        self.torch_threads = torch_threads
        self.readiness_timeout_s = readiness_timeout_s
        self.poll_interval_s = poll_interval_s
        self.runbook = runbook
        self.status_url = ""

    @cached_property
    def hook(self) -> TritonHook:
        from hybridflow.hooks.triton import TritonHook

        return TritonHook(self.triton_conn_id)

    @cached_property
    def repo(self) -> ModelRepository:
        from hybridflow.hooks.model_repository import open_repository

        return open_repository(self.repository, self.storage_conn_id)

    def validate_names(self) -> None:
        from hybridflow.utils.triton import Repository, check_model_name

        check_model_name(self.model_name)
        Repository.parse(self.repository)
        if self.readiness_timeout_s <= 0:
            raise ConfigError(f"readiness_timeout_s is {self.readiness_timeout_s}; give a positive number of seconds")

    def render_config(self, n_features: int, versions: tuple[int, ...]) -> str:
        from hybridflow.utils.triton import ModelConfigSpec, render_model_config

        return render_model_config(ModelConfigSpec(
            name=self.model_name, n_features=n_features, backend=self.backend, max_batch_size=self.max_batch_size,
            instance_count=self.instance_count, max_queue_delay_us=self.max_queue_delay_us,
            torch_threads=self.torch_threads, versions=versions,
        ))

    def serve_versions(self, n_features: int, versions: tuple[int, ...]) -> None:
        """Point the repository config's version policy at ``versions`` and make the server apply it: versions
        named stay or get loaded, the others are unloaded once the new set is ready. Raises with the server's
        message when a version fails to load."""
        self.repo.write_config(self.model_name, self.render_config(n_features, versions))
        self.hook.load_model(self.model_name)

    def ready_trigger(self, version: int, carry: dict[str, Any], load: bool = True) -> TritonModelReadyTrigger:
        from hybridflow.triggers.triton import TritonModelReadyTrigger

        return TritonModelReadyTrigger(
            triton_conn_id=self.triton_conn_id, model_name=self.model_name, version=version,
            timeout_s=self.readiness_timeout_s, load=load, poll_interval_s=self.poll_interval_s, carry=carry,
        )

    def smoke_set(self, version: int) -> SmokeSet:
        """The version's own smoke set: inputs and the outputs its file gave at export time."""
        from hybridflow.layout import SMOKE_FILE
        from hybridflow.utils.triton import parse_smoke

        data = self.repo.read(self.model_name, f"{version}/{SMOKE_FILE}")
        if data is None:
            raise ConfigError(f"{self.repo.uri}/{self.model_name}/{version}/{SMOKE_FILE} is missing; this version "
                              "was not published by the deploy operator: redeploy its export")
        return parse_smoke(json.loads(data), self.record(version).n_features,
                           f"{self.model_name}/{version}/{SMOKE_FILE}")

    def smoke_test(self, version: int, smoke: SmokeSet) -> SmokeResult:
        """The smoke inputs through the server, to this exact version; a failed request fails the test, a server
        that went away raises :class:`ServerUnavailable` (it says nothing about the version)."""
        from hybridflow.hooks.triton import ServerUnavailable

        try:
            outputs = self.hook.infer(self.model_name, smoke.inputs, version=version)
        except ServerUnavailable:
            raise
        except TritonError as exc:
            self.log.warning("smoke request failed: %s", exc)
            return smoke.check([])
        return smoke.check(outputs.tolist())

    def record(self, version: int) -> VersionRecord:
        from hybridflow.utils.triton import RECORD_FILE, VersionRecord

        data = self.repo.read(self.model_name, f"{version}/{RECORD_FILE}")
        if data is None:
            raise ConfigError(f"version {version} of {self.model_name} has no {RECORD_FILE} in {self.repo.uri}; "
                              f"complete versions: {sorted(self.repo.records(self.model_name))}")
        return VersionRecord.from_json(data.decode())

    def mark(self, version: int, status, reason: str = "") -> None:
        self.repo.write_record(self.model_name, self.record(version).with_status(status, now(), reason))

    def serving(self) -> tuple[int | None, dict[int, VersionRecord]]:
        """The version serving now (the server's READY versions, read against the records) and all records."""
        from hybridflow.utils.triton import serving_version

        records = self.repo.records(self.model_name)
        return serving_version(self.hook.ready_versions(self.model_name), records), records

    def route_to(self, version: int | None) -> None:
        """Every unversioned request to ``version`` (None: no release: the server's own choice), at once."""
        if self.hook.guard_url is None:
            return
        if version is None:
            self.hook.clear_release(self.model_name)
        else:
            self.hook.set_release(self.model_name, version)

    def wait_ready(self, version: int, carry: dict[str, Any], load: bool = True) -> dict[str, Any]:
        """Load and wait here (non-deferrable mode, on-call rollback): the trigger's own logic, in this process."""
        return run_sync(self.ready_trigger(version, carry, load).wait())

    def promote_version(self, version: int, previous: int | None, n_features: int) -> None:
        """``version`` alone serves: routed first, so no request goes to ``previous`` once it is unloaded."""
        from hybridflow.utils.triton import VersionStatus

        self.route_to(version)
        if previous != version:
            self.serve_versions(n_features, (version,))
        self.mark(version, VersionStatus.PROMOTED)

    def retire_version(self, version: int, previous: int | None, n_features: int, reason: str,
                       mark: bool = True) -> None:
        """``previous`` alone serves again (nothing when nothing served before): routed first, so from now on no
        unversioned request reaches ``version``; then ``version`` is unloaded and (``mark``) marked rolled back."""
        from hybridflow.utils.triton import VersionStatus

        self.route_to(previous)
        if previous is None:  # nothing served before: serve nothing rather than an unproven version
            self.hook.unload_model(self.model_name)
        elif previous != version:
            self.serve_versions(n_features, (previous,))
        if previous != version and mark:
            self.mark(version, VersionStatus.ROLLED_BACK, reason)


class TritonDeployOperator(TritonServingOperator):
    """
    Publishes an export as a new numbered version of a Triton model and releases it only when it proves itself.

    1. Publish atomically (rename locally; objects, then the record, then the config on S3); rerunning the same
       export (same sha256 of model.pt) reuses its version instead of publishing another.
    2. Load it beside the serving version (version policy ``[previous, new]``; model control over gRPC) and wait
       until it is READY, deferred to the triggerer; a failed load carries the server's message.
    3. Smoke test: the export's fixed inputs must give the outputs computed at export time, within ``atol``.
    4. Latency gate: ``gate_requests`` requests, ``concurrency`` in flight, on the new version; p99 over
       ``slo_p99_ms`` (or any failed request) fails it.
    5. Progressive release (``release.strategy: progressive``, when a version serves already): the guard holds
       unversioned requests on the serving version from the load on, then copies them to the new one (shadow),
       then sends it each canary share in turn; a deferred trigger judges every step on the guard's figures of
       both versions (error rate, p99, mean score shift and PSI). A failed step sets the split back to the
       previous version at once and unloads the new one; the figure and the threshold it broke are in the log
       and the report (``release.steps``).
    6. With ``approval: ask`` (and a version serving beside), the release stays at its last step and the task
       returns with ``release.awaiting_approval``; :func:`approval_tasks` asks a person, and
       :class:`TritonReleaseDecisionOperator` promotes or rolls back on the answer.
    7. Promote (policy ``[new]``: the previous version is unloaded only now) or roll back (policy ``[previous]``:
       the new version is unloaded, the previous never stopped serving), then raise :class:`ModelRolledBack`
       (retried: a latency breach or a load timeout may pass next time) or, when the server refused the load or
       the outputs were wrong, the same message as ``AirflowFailException`` (a retry cannot help).

    A server that restarts (or crashes, or shuts down) between the load and the promotion: the config is pointed
    back at ``[previous]`` at once (a server starting loads what it names), the task waits up to
    ``readiness_timeout_s`` for the server to answer, rolls back and raises :class:`ModelRolledBack` (retried).

    Returns, and pushes to XCom ``deploy_report`` also before raising: ``model``, ``version``,
    ``previous_version``, ``promoted``, ``load_s``, ``smoke`` {rows, max_abs_error, atol}, ``latency``
    {requests, concurrency, p50_ms, p99_ms, throughput_rps, failed}, plus ``reason``, ``reused_version``,
    ``sha256``, ``repository``, ``status_url``, ``slo_p99_ms``.

    Without the guard's release port (connection extra ``guard_port``; ``release.strategy: direct`` only),
    requests without a version go to the newest READY version, so once the new version is ready it takes that
    traffic for the few seconds of the gates. With it, they stay on the serving version until the release says.

    :param export_dir: the training job's ``export/`` directory (templated).
    :param version: instead of an export, a version published before (templated; a version rolled back
        earlier, released again): nothing is published.
    :param approval: ``auto`` (promote when every check passes) or ``ask`` (hold for a person; templated).
    :param model_uri: the registry version it is (``models:/<name>/<N>``, templated), kept in the Triton version's
        record so a served version leads back to its registry version and run.
    :param slo_p99_ms: the latency budget of one request at p99.
    :param concurrency: requests in flight during the latency gate; ``gate_requests`` how many in all, the first
        ``gate_warmup_requests`` of them left out of the percentiles.
    :param release: how the version meets real traffic (:class:`~hybridflow.config.ReleaseConfig`).
    :param deferrable: wait for readiness in the triggerer instead of holding a worker slot (default: Airflow's
        ``[operators] default_deferrable``).
    """

    template_fields: Sequence[str] = ("export_dir", "version", "approval", "model_uri", "model_name", "repository")

    def __init__(
        self,
        *,
        export_dir: str = "",
        version: int | str = 0,
        approval: str = "auto",
        model_uri: str = "",
        slo_p99_ms: float = ServingConfig.slo_p99_ms,
        concurrency: int = ServingConfig.gate_concurrency,
        gate_requests: int = ServingConfig.gate_requests,
        gate_warmup_requests: int = ServingConfig.gate_warmup_requests,
        release: ReleaseConfig | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.release = release or ReleaseConfig()
        self.export_dir = export_dir
        self.version = version
        self.approval = approval
        self.model_uri = model_uri
        self.slo_p99_ms = slo_p99_ms
        self.concurrency = concurrency
        self.gate_requests = gate_requests
        self.gate_warmup_requests = gate_warmup_requests
        self.deferrable = deferrable

    def validate(self) -> None:
        from hybridflow.pipeline.registry import parse_version_uri

        self.validate_names()
        if self.approval not in APPROVALS:
            raise ConfigError(f"approval is {self.approval!r}; choose {' or '.join(APPROVALS)}")
        if bool(self.export_dir) == bool(self.published_version()):
            raise ConfigError(f"export_dir {self.export_dir!r}, version {self.version!r}: give one of them (an "
                              "export to publish, or the number of a version published before)")
        if self.model_uri:
            parse_version_uri(self.model_uri, "model_uri")
        if not self.slo_p99_ms > 0:
            raise ConfigError(f"slo_p99_ms is {self.slo_p99_ms}; give the p99 budget in milliseconds "
                              f"(default {ServingConfig.slo_p99_ms:g})")
        for key in ("concurrency", "gate_requests"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key} is {value!r}; give a positive integer")
        warmup = self.gate_warmup_requests
        if not isinstance(warmup, int) or isinstance(warmup, bool) or not 0 <= warmup < self.gate_requests:
            raise ConfigError(f"gate_warmup_requests is {warmup!r}; give a whole number from 0 to gate_requests - 1 "
                              f"({self.gate_requests - 1})")
        self.release.validate("release")
        if self.release.strategy == "progressive" and self.hook.guard_url is None:
            raise ConfigError(f"release.strategy is progressive but connection {self.triton_conn_id!r} names no "
                              "guard_port (the guard splits the traffic); add the extra, or use strategy: direct")

    def published_version(self) -> int:
        return version_number(self.version, "version", "a published version number (0: publish export_dir)")

    def release_steps(self) -> list[tuple[str, int]]:
        """``(mode, candidate share)`` of each judged step: shadow (when ``shadow_s``), then the canary shares
        below 100 (100 is the promotion)."""
        steps = [("shadow", 0)] if self.release.shadow_s > 0 else []
        return steps + [("canary", share) for share in self.release.canary_steps if share < 100]

    def execute(self, context: Context) -> dict:
        try:
            return self._publish_and_load(context)
        except ConfigError as exc:
            raise final(exc) from exc
        finally:
            self.hook.close()

    def _publish_and_load(self, context: Context) -> dict:
        from hybridflow.utils.triton import VersionRecord, find_published, next_version, read_export

        self.validate()
        previous, records = self.serving()
        if self.published_version():
            record = records[self._published(records)]
            self._check_inputs(previous, records, record.n_features)
            return self._load(context, previous, record, reused=True)
        bundle = read_export(Path(self.export_dir))
        self._check_inputs(previous, records, bundle.signature.n_features)
        version = find_published(records, bundle.sha256)
        reused = version is not None
        if version is None:
            version = next_version(self.repo.versions(self.model_name))
            record = VersionRecord(version=version, sha256=bundle.sha256, n_features=bundle.signature.n_features,
                                   source=str(bundle.directory), published_at=now(), model_uri=self.model_uri or "")
            self.repo.publish_version(self.model_name, version, bundle.version_files(), record)
            self.log.info("Published %s version %s (sha256 %s) to %s", self.model_name, version, bundle.sha256[:12],
                          self.repo.uri)
        else:
            self.log.info("%s version %s already holds this model.pt (sha256 %s): reusing it", self.model_name,
                          version, bundle.sha256[:12])
            if self.model_uri and records[version].model_uri != self.model_uri:  # deployed before it was registered
                self.repo.write_record(self.model_name, replace(records[version], model_uri=self.model_uri))
            record = replace(records[version], model_uri=self.model_uri or records[version].model_uri)
        return self._load(context, previous, record, reused)

    def _published(self, records: dict[int, VersionRecord]) -> int:
        version = self.published_version()
        if version not in records:
            raise ConfigError(f"version {version} of {self.model_name} is not a complete version in {self.repo.uri}; "
                              f"complete versions: {sorted(records)}")
        return version

    def _check_inputs(self, previous: int | None, records: dict[int, VersionRecord], n_features: int) -> None:
        if previous is not None and previous in records and records[previous].n_features != n_features:
            raise ConfigError(
                f"{self.export_dir or f'version {self.version}'}: the model takes {n_features} features but version "
                f"{previous} of {self.model_name} (serving) takes {records[previous].n_features}; clients send a "
                "different input now: deploy it under a new model_name"
            )

    def _load(self, context: Context, previous: int | None, record: VersionRecord, reused: bool) -> dict:
        """Load ``record``'s version beside the serving one (the guard holds unversioned requests on that) and
        wait until it is READY, deferred."""
        from hybridflow.utils.triton import loaded_versions

        version = record.version
        loaded = loaded_versions(previous, version)
        if previous not in (None, version):
            self.route_to(previous)  # the new version answers no unversioned request before its release says
        changed = self.repo.write_config(self.model_name, self.render_config(record.n_features, loaded))
        self.log.info("Loading %s versions %s (serving now: %s, until promotion)", self.model_name, list(loaded),
                      previous)
        carry = {"version": version, "previous_version": previous, "reused_version": reused,
                 "sha256": record.sha256, "n_features": record.n_features, "model_uri": record.model_uri}
        # Rerunning the deploy of the version serving now needs no load: only the checks.
        load = changed or previous != version
        if self.deferrable:
            self.defer(trigger=self.ready_trigger(version, carry, load=load), method_name="execute_complete",
                       timeout=timedelta(seconds=self.readiness_timeout_s + 120))
        return self._release(context, self.wait_ready(version, carry, load=load))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        missing = {"status", "carry", "message"} - set(event or {})
        if missing:
            raise TritonError(f"malformed trigger event (missing {sorted(missing)}): {event}")
        try:
            return self._release(context, event)
        finally:
            self.hook.close()

    def _release(self, context: Context, event: dict[str, Any]) -> dict:
        from hybridflow.hooks.triton import ServerUnavailable

        carry = event["carry"]
        version, previous = carry["version"], carry["previous_version"]
        self.status_url = self.hook.model_status_url(self.model_name, version)
        report = {
            "model": self.model_name, "version": version, "previous_version": previous, "promoted": False,
            "reused_version": carry["reused_version"], "sha256": carry["sha256"], "repository": self.repo.uri,
            "model_uri": carry.get("model_uri", ""),
            "status_url": self.status_url, "slo_p99_ms": self.slo_p99_ms, "load_s": None, "smoke": None,
            "latency": None, "release": None, "reason": None,
        }
        if event["status"] == "restarted":
            return self._server_went_away(context, report, carry, event["message"])
        if event["status"] != "ready":
            # A load the server refused will be refused again; one that ran out of time may not.
            return self._roll_back(context, report, carry, f"version {version} did not load: {event['message']}",
                                   retryable=event["status"] != "failed")
        report["load_s"] = event.get("load_s")
        self.log.info("%s version %s READY after %.2f s", self.model_name, version, report["load_s"] or 0)
        try:
            return self._prove_and_promote(context, report, carry)
        except ServerUnavailable as exc:
            return self._server_went_away(context, report, carry, str(exc))

    def _prove_and_promote(self, context: Context, report: dict, carry: dict) -> dict:

        version, previous = carry["version"], carry["previous_version"]
        smoke_set = self.smoke_set(version)
        smoke = self.smoke_test(version, smoke_set)
        report["smoke"] = smoke.to_dict()
        if not smoke.passed:
            return self._roll_back(context, report, carry, (
                f"smoke test failed: max abs error {smoke.max_abs_error:.3g} over {smoke.rows} rows is above "
                f"atol {smoke.atol:g} (the outputs differ from those computed at export)"), retryable=False)
        verdict = self._latency_gate(report, version, previous, smoke_set.inputs)
        if verdict.outcome == HOLD:
            reason = f"latency gate held: {'; '.join(verdict.reasons)}"
            self._alert_held(context, f"{self.model_name} version {version}: {reason}; retrying", verdict.checks)
            return self._roll_back(context, report, carry, f"{reason}; retrying", retryable=True, held=True)
        if verdict.outcome == FAIL:
            # Retried: the gate measures again (a machine busy for a while passes the next time).
            return self._roll_back(context, report, carry, f"latency gate failed: {'; '.join(verdict.reasons)}; "
                                   "retrying", retryable=True)

        if self.release.strategy == "progressive" and previous not in (None, version) and self.release_steps():
            report["release"] = {"strategy": "progressive", "steps": [], "no_traffic": False}
            return self._start_step(context, report, carry, 0)
        return self._finish(context, report, carry)

    def _latency_gate(self, report: dict, version: int, previous: int | None, rows) -> Verdict:
        """``gate_requests`` on the new version; where a version serves, the same load on it at the same time, so
        the machine's load weighs on both alike (utils/release.py ``judge_gate``)."""
        beside = previous not in (None, version)
        # Beside: the same requests in flight in all as alone, half on each version.
        measured = self.hook.measure_latencies(
            self.model_name, [version, previous] if beside else [version], rows,
            concurrency=max(1, self.concurrency // 2) if beside else self.concurrency,
            requests=self.gate_requests, warmup=self.gate_warmup_requests, confidence=self.release.confidence)
        (latency, candidate_ms), baseline = measured[0], (measured[1] if beside else None)
        report["latency"] = latency.to_dict()
        # A server shutting down still answers for a while (it drains its connections): failed or slow requests
        # may be that, not the version, and what the version proved there does not outlive the restart.
        self.hook.check_server()
        verdict = judge_gate(candidate_ms, latency.failed, self.slo_p99_ms, self.release,
                             *((baseline[1], baseline[0].failed) if baseline else ()))
        if baseline:
            report["latency"]["baseline"] = {"version": previous, **baseline[0].to_dict()}
        report["latency"]["decision"] = f"{verdict.outcome}: {latency.explain()}; " + "; ".join(verdict.checks)
        self.log.info("Latency gate of %s version %s%s: %s", self.model_name, version,
                      f" beside version {previous} under the same load" if beside else "", verdict.outcome)
        for line in (latency.explain(), *(["serving version: " + baseline[0].explain()] if baseline else []),
                     *verdict.checks):
            self.log.info("  %s", line)
        return verdict

    def _alert_held(self, context: Context, message: str, details: Sequence[str]) -> None:
        """On-call hears of a judgement held for the machine (best effort: never fails the task itself)."""
        from hybridflow.config import pipeline_config
        from hybridflow.notifiers.oncall import RELEASE_HELD, send_task_alert

        try:
            send_task_alert(context["ti"], pipeline_config().alerts, kind=RELEASE_HELD, error=message,
                            details="\n".join(details))
        except Exception as exc:  # noqa: BLE001 - the task's own failure still says it
            self.log.warning("could not send the on-call alert (%s)", exc)

    def _finish(self, context: Context, report: dict, carry: dict) -> dict:
        """Every check passed: promote, or (``approval: ask``, a version serving beside) hold for a person."""
        if self.approval == "ask" and carry["previous_version"] not in (None, carry["version"]):
            return self._hold(context, report, carry)
        return self._promote(context, report, carry)

    def _hold(self, context: Context, report: dict, carry: dict) -> dict:
        """Leave the release where its last step put it (both versions loaded) for the approval task."""
        release = report["release"] = report.get("release") or {"strategy": self.release.strategy, "steps": [],
                                                                 "no_traffic": False}
        release["awaiting_approval"] = True
        report["reason"] = "awaiting approval"
        steps = release["steps"]
        where = (f"{step_label(steps[-1]['mode'], steps[-1]['share'])} of unversioned requests" if steps else
                 "no unversioned request")
        self.log.info("%s version %s passed every check; it keeps %s while a person decides (the approval task: "
                      "Promote or Roll back; version %s serves the rest). Figures: %s", self.model_name,
                      carry["version"], where, carry["previous_version"], self._figures(report))
        context["ti"].xcom_push(key=XCOM_REPORT, value=report)
        return report

    def _promote(self, context: Context, report: dict, carry: dict) -> dict:
        version, previous = carry["version"], carry["previous_version"]
        self.promote_version(version, previous, carry["n_features"])
        report["promoted"] = True
        unloaded = f"version {previous} unloaded" if previous not in (None, version) else "it was the only version"
        self.log.info("Promoted %s version %s (%s): %s", self.model_name, version, unloaded, self._figures(report))
        context["ti"].xcom_push(key=XCOM_REPORT, value=report)
        return report

    def _start_step(self, context: Context, report: dict, carry: dict, index: int) -> dict:
        """Set the release of step ``index`` on the guard and judge it (deferred, or here)."""
        from hybridflow.triggers.triton import TritonReleaseStepTrigger

        mode, share = self.release_steps()[index]
        version, previous = carry["version"], carry["previous_version"]
        release = self.hook.set_release(self.model_name, previous, version, mode=mode, share=share)
        window = self.release.shadow_s if mode == "shadow" else self.release.step_min_s
        timeout = None if self.release.no_traffic == "wait" else self.release.step_timeout_s
        self.log.info("%s version %s: %s (%s), at least %.0f s and %d requests per version, judged against "
                      "version %s", self.model_name, version, step_label(mode, share),
                      "copies of every unversioned request, answers compared" if mode == "shadow" else
                      f"{share}% of unversioned requests", window, self.release.min_requests, previous)
        trigger = TritonReleaseStepTrigger(
            triton_conn_id=self.triton_conn_id, model_name=self.model_name, generation=release["generation"],
            thresholds=asdict(self.release.thresholds()), min_window_s=window, timeout_s=timeout,
            poll_interval_s=min(2.0, max(0.5, window / 5)), carry={**carry, "report": report, "step": index})
        if self.deferrable:
            self.defer(trigger=trigger, method_name="step_complete",
                       timeout=None if timeout is None else timedelta(seconds=timeout + 120))
        return self._step_done(context, run_sync(trigger.wait()))

    def step_complete(self, context: Context, event: dict[str, Any]) -> dict:
        from hybridflow.hooks.triton import ServerUnavailable

        missing = {"status", "carry", "message"} - set(event or {})
        if missing:
            raise TritonError(f"malformed trigger event (missing {sorted(missing)}): {event}")
        carry = dict(event["carry"])
        report = carry.pop("report")
        try:
            return self._step_done(context, event)
        except ServerUnavailable as exc:
            return self._server_went_away(context, report, carry, str(exc))
        finally:
            self.hook.close()

    def _step_done(self, context: Context, event: dict[str, Any]) -> dict:
        carry = dict(event["carry"])
        report, index = carry.pop("report"), carry.pop("step")
        mode, share = self.release_steps()[index]
        verdict = event.get("verdict") or {}
        report["release"]["steps"].append({"mode": mode, "share": share, "outcome": event["status"],
                                           "seconds": event.get("seconds"), "figures": verdict.get("figures", {}),
                                           "reasons": verdict.get("reasons", []),
                                           "checks": verdict.get("checks", [])})
        label, status = step_label(mode, share), event["status"]
        self.log.info("%s version %s, %s: %s (%s); figures %s", self.model_name, carry["version"], label, status,
                      event["message"], verdict.get("figures", {}))
        for line in verdict.get("checks", []):
            self.log.info("  %s: %s", label, line)
        report["release"]["decision"] = f"{label} {status}: " + "; ".join(verdict.get("checks") or [event["message"]])
        if status == "pass":
            if index + 1 < len(self.release_steps()):
                return self._start_step(context, report, carry, index + 1)
            return self._finish(context, report, carry)
        if status == "fail":
            return self._roll_back(context, report, carry, f"{label} failed: {event['message']} "
                                   f"(serving.release thresholds)", retryable=False)
        if status == "no_traffic" and self.release.no_traffic == "promote":
            report["release"]["no_traffic"] = True
            self.log.warning("%s version %s, %s: %s; promoting on the smoke set and the latency gate alone "
                             "(serving.release.no_traffic: promote)", self.model_name, carry["version"], label,
                             event["message"])
            return self._finish(context, report, carry)
        if status == "no_traffic":
            return self._roll_back(context, report, carry, f"{label}: too little traffic to judge ({event['message']}; "
                                   "serving.release.no_traffic: fail)", retryable=False)
        if status == "held":
            return self._held(context, report, carry, f"{label} held: {event['message']}")
        if status == "superseded":
            report["reason"] = event["message"]
            context["ti"].xcom_push(key=XCOM_REPORT, value=report)
            raise final(TritonError(f"{self.model_name} version {carry['version']} is not promoted: "
                                    f"{event['message']}. Whoever changed it (an on-call rollback) owns the "
                                    f"release now; nothing was changed. Runbook: {self.runbook}"))
        return self._roll_back(context, report, carry, f"{label}: {event['message']}", retryable=True)

    def _held(self, context: Context, report: dict, carry: dict, reason: str) -> dict:
        """Both versions broke the same absolute limit: the machine, not the candidate. Nothing is rolled back or
        marked; on-call hears of it and the task fails to be retried (a retry starts the release again from its
        gates, once the machine recovers)."""
        report["reason"] = reason
        context["ti"].xcom_push(key=XCOM_REPORT, value=report)
        message = (f"{self.model_name} version {carry['version']} is held, not rolled back: {reason}. Version "
                   f"{carry['previous_version']} serves the rest; the task will be retried. Runbook: {self.runbook}")
        self.log.error("%s", message)
        self._alert_held(context, message, report["release"]["steps"][-1]["checks"])
        raise TritonError(message)

    def _roll_back(self, context: Context, report: dict, carry: dict, reason: str, retryable: bool,
                   restarted: bool = False, held: bool = False) -> dict:
        """``held``: the machine's fault, not the version's: unloaded as in a rollback but not marked rolled back."""
        from hybridflow.hooks.triton import ServerUnavailable

        version, previous = carry["version"], carry["previous_version"]
        report["reason"] = reason
        self.log.error("Rolling back %s version %s: %s", self.model_name, version, reason)
        try:
            self.retire_version(version, previous, carry["n_features"], reason, mark=not held)
        except ServerUnavailable as exc:
            if restarted:
                context["ti"].xcom_push(key=XCOM_REPORT, value=report)
                raise TritonError(f"{self.model_name} version {version} failed ({reason}) and the server went away "
                                  f"again during the rollback to version {previous}: {exc}. "
                                  f"Runbook: {self.runbook}") from exc
            return self._server_went_away(context, report, carry, f"{exc}, while rolling back because {reason}")
        except TritonError as exc:
            context["ti"].xcom_push(key=XCOM_REPORT, value=report)
            raise TritonError(f"{self.model_name} version {version} failed ({reason}) and the rollback to version "
                              f"{previous} failed too: {exc}. Runbook: {self.runbook}") from exc
        try:
            still: list[int] | str = self.hook.ready_versions(self.model_name)
        except ServerUnavailable as exc:  # rolled back already; the server is going away again (a restart)
            still = f"unknown, {exc}"
        context["ti"].xcom_push(key=XCOM_REPORT, value=report)
        serving = f"version {previous} keeps serving" if previous is not None else "nothing was serving before"
        what = "was unloaded, not marked rolled back (held for the machine)" if held else "was rolled back"
        error = ModelRolledBack(
            f"{self.model_name} version {version} {what}: {reason}. {serving} (READY now: {still}). "
            f"Figures: {self._figures(report)}. Runbook: {self.runbook}", report)
        raise error if retryable else final(error)

    def _server_went_away(self, context: Context, report: dict, carry: dict, cause: str) -> dict:
        """The server restarted (or crashed) mid-deploy: point the config back at the previous version first, so
        a server starting now loads only that, wait for it to answer, then roll back as usual (retried)."""
        version, previous = carry["version"], carry["previous_version"]
        self.log.error("Triton went away mid-deploy of %s version %s: %s", self.model_name, version, cause)
        if previous not in (None, version):
            self.repo.write_config(self.model_name, self.render_config(carry["n_features"], (previous,)))
        back_s = self.hook.wait_server_ready(self.readiness_timeout_s, self.poll_interval_s)
        reason = f"the Triton server restarted mid-deploy ({cause})"
        if back_s is None:
            report["reason"] = reason
            context["ti"].xcom_push(key=XCOM_REPORT, value=report)
            if previous is None:
                serves = (f"its config names version {version}, which it will load when it starts: unload the "
                          "model or rerun this task")
            else:
                serves = f"its config names only version {previous}, which it will serve when it starts"
            raise TritonError(f"{self.model_name} version {version} is not released: {reason}, and the server did "
                              f"not answer again within {self.readiness_timeout_s:.0f} s; {serves}. "
                              f"Runbook: {self.runbook}")
        return self._roll_back(context, report, carry, f"{reason}; it answered again {back_s:.1f} s later",
                               retryable=True, restarted=True)

    @staticmethod
    def _figures(report: dict) -> str:
        latency, smoke = report.get("latency") or {}, report.get("smoke") or {}
        parts = [f"load {report['load_s']} s" if report.get("load_s") is not None else "load -"]
        if smoke:
            error = "no output" if smoke["max_abs_error"] is None else f"{smoke['max_abs_error']:.3g}"
            parts.append(f"smoke {smoke['rows']} rows max_abs_error {error} (atol {smoke['atol']:g})")
        if latency:
            parts.append(f"p50 {latency['p50_ms']} ms p99 {latency['p99_ms']} ms (SLO {report['slo_p99_ms']:g} ms) "
                         f"{latency['throughput_rps']} req/s at concurrency {latency['concurrency']}, "
                         f"{latency['failed']} failed of {latency['requests']}")
        return "; ".join(parts)


class TritonReleaseDecisionOperator(TritonServingOperator):
    """
    Ends a release held for approval (:class:`TritonDeployOperator` with ``approval: ask``) as the person chose in
    the approval task: ``Promote`` -> the new version alone serves (the old one unloaded); ``Roll back`` -> the old
    version alone serves again (the new one unloaded, marked rolled back). Nobody answering in time (the approval
    task's default) rolls back and fails, so on-call hears of it; a person's ``Roll back`` is their decision and
    succeeds. A release that changed meanwhile (an on-call rollback) is left as it is, and the task says so.

    Returns, and pushes to XCom ``deploy_report``, the deploy's report with ``promoted``, ``reason`` and
    ``release.approval`` {choice, by, at, timed_out}.

    :param deploy_task_id: the deploy task whose ``deploy_report`` held the release.
    :param approval_task_id: the approval task (the standard provider's HITLOperator, options
        :data:`~hybridflow.utils.release.APPROVAL_OPTIONS`).
    """

    def __init__(self, *, deploy_task_id: str, approval_task_id: str, **kwargs):
        super().__init__(**kwargs)
        self.deploy_task_id = deploy_task_id
        self.approval_task_id = approval_task_id

    def execute(self, context: Context) -> dict:
        from hybridflow.utils.release import approval_answer

        ti = context["ti"]
        report = ti.xcom_pull(task_ids=self.deploy_task_id, key=XCOM_REPORT) or {}
        if not awaiting_approval(report):
            raise final(TritonError(f"{self.deploy_task_id} holds no release awaiting approval "
                                    f"({report.get('reason')}); nothing to decide"))
        try:
            answer = approval_answer(ti.xcom_pull(task_ids=self.approval_task_id))
            return self._decide(context, report, answer)
        except (ConfigError, ValueError) as exc:
            raise final(exc) from exc
        finally:
            self.hook.close()

    def _decide(self, context: Context, report: dict, answer) -> dict:
        version, previous = report["version"], report["previous_version"]
        self.status_url = self.hook.model_status_url(self.model_name, version)
        report = {**report, "release": {**report["release"], "awaiting_approval": False,
                                        "approval": answer.as_dict()}}
        ready = self.hook.ready_versions(self.model_name)
        # The version to keep must still be loaded; the other may be gone already (this task's own earlier try:
        # both switches are safe to repeat).
        if (version if answer.promote else previous) not in ready:
            report["reason"] = f"the release changed while it waited for approval (READY now: {ready})"
            context["ti"].xcom_push(key=XCOM_REPORT, value=report)
            raise final(TritonError(f"{self.model_name} version {version}: {report['reason']}. Whoever changed it "
                                    f"(an on-call rollback) owns it now; nothing was changed. Runbook: {self.runbook}"))
        n_features = self.record(version).n_features
        who = "nobody answered in time" if answer.timed_out else f"{answer.by} chose {answer.as_dict()['choice']}"
        if answer.promote:
            self.promote_version(version, previous, n_features)
            report.update(promoted=True, reason=None)
            self.log.info("Promoted %s version %s (%s); version %s unloaded", self.model_name, version, who, previous)
            context["ti"].xcom_push(key=XCOM_REPORT, value=report)
            return report
        report["reason"] = f"not approved: {who}"
        self.retire_version(version, previous, n_features, report["reason"])
        self.log.warning("Rolled %s back to version %s: version %s %s", self.model_name, previous, version,
                         report["reason"])
        context["ti"].xcom_push(key=XCOM_REPORT, value=report)
        if answer.timed_out:
            raise final(ModelRolledBack(f"{self.model_name} version {version} was rolled back: {report['reason']} "
                                        f"(serving.release.approval_timeout_s). Version {previous} keeps serving. "
                                        f"Runbook: {self.runbook}", report))
        return report


def approval_tasks(deploy: TritonDeployOperator, release: ReleaseConfig) -> BaseOperator:
    """After ``deploy`` (``approval: ask``): ``needs_approval`` (skips the rest unless the deploy holds a release),
    ``approve_release`` (Airflow's human-in-the-loop: Promote or Roll back, the figures shown; Roll back when
    nobody answers within ``release.approval_timeout_s``), ``finish_release`` (does it). Returns the last."""
    from airflow.providers.standard.operators.hitl import HITLOperator
    from airflow.providers.standard.operators.python import ShortCircuitOperator

    from hybridflow.utils.release import APPROVAL_OPTIONS, ROLL_BACK

    prefix = deploy.task_id[: -len(deploy.task_id.split(".")[-1])]  # its task group's, if any
    needs = ShortCircuitOperator(task_id="needs_approval", python_callable=held_release,
                                 op_kwargs={"deploy_task_id": deploy.task_id, "timeout_s": release.approval_timeout_s},
                                 ignore_downstream_trigger_rules=False)
    asked = "{{ ti.xcom_pull(task_ids='" + prefix + "needs_approval')"
    approve = HITLOperator(task_id="approve_release", subject=asked + "['subject'] }}", body=asked + "['body'] }}",
                           options=list(APPROVAL_OPTIONS), defaults=[ROLL_BACK],
                           response_timeout=timedelta(seconds=release.approval_timeout_s))
    decide = TritonReleaseDecisionOperator(
        task_id="finish_release", deploy_task_id=deploy.task_id, approval_task_id=prefix + "approve_release",
        **{key: getattr(deploy, key) for key in ("model_name", "repository", "triton_conn_id", "storage_conn_id",
                                                 "backend", "instance_count", "max_batch_size", "max_queue_delay_us",
                                                 "readiness_timeout_s")},
        pool=deploy.pool)
    deploy >> needs >> approve >> decide
    return decide


def held_release(deploy_task_id: str, timeout_s: float, ti=None) -> dict | bool:
    """The approval request (subject, body) when the deploy holds a release for a person, else False."""
    from hybridflow.utils.release import approval_request

    report = ti.xcom_pull(task_ids=deploy_task_id, key=XCOM_REPORT) or {}
    if not awaiting_approval(report):
        print(f"No approval to ask: the deploy {'promoted' if report.get('promoted') else 'did not hold'} "
              f"{report.get('model')} version {report.get('version')}")
        return False
    return approval_request(report, timeout_s)


class TritonRollbackOperator(TritonServingOperator):
    """
    On-call rollback: restores ``version`` (0: the version promoted before the one serving now), proves it and
    only then unloads the current one. The target is loaded beside the current version, must become READY and
    give its export-time outputs on its own smoke set; the version policy then becomes ``[target]``.

    Retries are safe when the version is fixed: a retry that finds the target already serving verifies it and
    marks the records. Resolve 0 once, in an upstream task (:meth:`plan`), and pass the number here, so a retry
    after a successful switch does not walk back one more version. Returns ``model``, ``version``,
    ``rolled_back_from``, ``load_s``, ``smoke`` and ``status_url``.

    :param version: the version to restore (templated); 0: the previously promoted one.
    :param from_version: the version being rolled back (templated); 0: the one serving now.
    """

    template_fields: Sequence[str] = ("model_name", "repository", "version", "from_version")

    def __init__(self, *, version: int | str = 0, from_version: int | str = 0, **kwargs):
        super().__init__(**kwargs)
        self.version = version
        self.from_version = from_version

    def plan(self) -> dict[str, Any]:
        """``{"model", "version", "from_version"}``: what this rollback would do now (0 = nothing serving)."""
        from hybridflow.utils.triton import rollback_target

        self.validate_names()
        current, records = self.serving()
        target = version_number(self.version, "version", "a version number, or 0")
        release = (self.hook.release(self.model_name) or {}).get("release") if self.hook.guard_url else None
        if release and release["mode"] != "stable":
            # A release in shadow or canary: rolling back ends it, back to the version it judges against.
            current, target = release["candidate"], target or release["stable"]
        current = version_number(self.from_version, "from_version", "a version number, or 0") or current
        if target and target not in records:
            raise ConfigError(f"version {target} of {self.model_name} is not a complete version in {self.repo.uri}; "
                              f"complete versions: {sorted(records)}")
        if not target:
            target = rollback_target(current, records)
        if target is None:
            raise ConfigError(f"{self.model_name}: no version was promoted before version {current} in "
                              f"{self.repo.uri} (versions: {sorted(records)}); give the version to restore")
        return {"model": self.model_name, "version": target, "from_version": current or 0}

    def execute(self, context: Context) -> dict:
        try:
            return self._roll_back_to_plan()
        except ConfigError as exc:
            raise final(exc) from exc
        finally:
            self.hook.close()

    def _roll_back_to_plan(self) -> dict:
        from hybridflow.utils.triton import VersionStatus, loaded_versions

        plan = self.plan()
        target, rolled_back_from = plan["version"], plan["from_version"] or None
        current, records = self.serving()
        n_features = records[target].n_features
        self.status_url = self.hook.model_status_url(self.model_name, target)
        if current not in (None, target) and records.get(current) and records[current].n_features != n_features:
            raise ConfigError(f"version {target} takes {n_features} features, the serving version {current} "
                              f"{records[current].n_features}: clients would send the wrong input; not rolling back")
        self.log.info("Rolling %s back from version %s to version %s (serving now: %s)", self.model_name,
                      rolled_back_from, target, current)
        if target in self.hook.ready_versions(self.model_name):
            # Loaded still (a release in shadow or canary, or a rerun): every unversioned request to it at once;
            # a deploy judging a step sees its release changed and stops without promoting.
            self.route_to(target)
        changed = self.repo.write_config(self.model_name,
                                         self.render_config(n_features, loaded_versions(current, target)))
        event = self.wait_ready(target, {}, load=changed or current != target)
        if event["status"] != "ready":
            self._restore(current, n_features)
            raise TritonError(f"version {target} of {self.model_name} did not load: {event['message']}; version "
                              f"{current} keeps serving. Runbook: {self.runbook}")
        smoke = self.smoke_test(target, self.smoke_set(target))
        if not smoke.passed:
            self._restore(current, n_features)
            raise TritonError(f"version {target} of {self.model_name} fails its smoke test (max abs error "
                              f"{smoke.max_abs_error:.3g} > atol {smoke.atol:g}); version {current} keeps serving. "
                              f"Runbook: {self.runbook}")
        self.route_to(target)
        if self.hook.ready_versions(self.model_name) != [target]:
            self.serve_versions(n_features, (target,))
        ready = self.hook.ready_versions(self.model_name)
        if ready != [target]:
            raise TritonError(f"{self.model_name}: after the rollback the READY versions are {ready}, not [{target}]. "
                              f"Runbook: {self.runbook}")
        if rolled_back_from not in (None, target) and rolled_back_from in records:
            self.mark(rolled_back_from, VersionStatus.ROLLED_BACK, f"on-call rollback to version {target}")
        self.mark(target, VersionStatus.PROMOTED, f"on-call rollback from version {rolled_back_from}")
        self.log.info("%s serves version %s again (was %s); smoke max abs error %.3g over %s rows, load %.2f s",
                      self.model_name, target, rolled_back_from, smoke.max_abs_error, smoke.rows,
                      event.get("load_s") or 0)
        return {"model": self.model_name, "version": target, "rolled_back_from": rolled_back_from,
                "load_s": event.get("load_s"), "smoke": smoke.to_dict(), "status_url": self.status_url,
                "model_uri": records[target].model_uri}

    def _restore(self, current: int | None, n_features: int) -> None:
        if current is None:
            self.hook.unload_model(self.model_name)
        else:
            self.serve_versions(n_features, (current,))


class TritonRollbackPlanOperator(TritonRollbackOperator):
    """Resolves, once, which version an on-call rollback restores and from which: returns :meth:`plan`'s dict
    for the rollback task, which can then be retried without walking back further."""

    def execute(self, context: Context) -> dict:
        try:
            plan = self.plan()
        except ConfigError as exc:
            raise final(exc) from exc
        finally:
            self.hook.close()
        self.status_url = self.hook.model_status_url(self.model_name, plan["version"])
        self.log.info("Rollback plan for %s: restore version %s (serving now: %s)", self.model_name, plan["version"],
                      plan["from_version"] or "nothing")
        return plan
