"""Submit a batch job to a Slurm partition over SSH, exactly once per task, and wait for it deferred."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, conf

from hybridflow.config import ClusterConfig, RecoveryConfig
from hybridflow.exceptions import SlurmConnectionError, SlurmJobFailed
from hybridflow.ui import SlurmJobLink
from hybridflow.utils.slurm import whole_number

if TYPE_CHECKING:
    from airflow.sdk import Context

    from hybridflow.hooks.slurm import SlurmHook
    from hybridflow.utils.slurm_jobs import SlurmJobKey, SlurmJobStatus
    from hybridflow.utils.stalls import StallWatch

XCOM_JOB_ID = "slurm_job_id"
XCOM_EFFICIENCY = "efficiency"  # the ended job's figures from Slurm's accounting (utils/efficiency.py)
DEFAULT_RUNBOOK = "include/runbooks/training.md"


class SlurmSubmitOperator(BaseOperator):
    """
    Runs ``command`` as a batch job on a Slurm partition and succeeds when the job ends COMPLETED.

    Safe against duplicates: the job's name is derived from the DAG, task and run; before submitting, the
    operator looks the name up in the queue and in accounting and follows a live job (or one that already
    succeeded) instead of submitting again, so a retry, a killed worker or a restarted triggerer never runs
    the job twice. While deferred it logs the job's progress file; ``on_kill`` cancels the job. The job's
    comment names its task instance (:class:`~hybridflow.utils.slurm_jobs.SlurmJobKey`), so the orphan reconciler
    can cancel a job whose task stopped without hearing of it.

    :param command: argv of the job's program; every element is quoted (templated).
    :param partition: Slurm partition (templated).
    :param nodes: nodes to allocate (templated).
    :param gpus_per_node: GPUs per node; ``gpu_type`` optionally names the GRES type (templated).
    :param ranks_per_node: 0 runs ``command`` once as the batch script; N starts it as one ``srun`` step of N
        ranks per node, one GPU each, the step killed when any rank fails (templated). Before submitting such a
        job the operator refuses a shape no set of the partition's nodes could ever run.
    :param log_dir: directory on the cluster for the job's stdout/stderr (templated); created if missing.
    :param progress_path: the job's progress JSON on the cluster, logged while waiting (templated).
    :param env: environment variables exported in the batch script (templated).
    :param setup_lines: trusted shell lines from configuration (module loads, venv activation); never user input.
    :param requeue: let Slurm requeue the job on preemption or node failure; followed up to ``max_requeues``.
    :param signal: ``SIG@seconds`` sent before the time limit so the job can checkpoint.
    :param deferrable: wait in the triggerer instead of holding a worker slot (default: Airflow's ``[operators]
        default_deferrable``, true on the local stack and in docker-compose).
    :param wait_before_defer_s: a deferrable task first waits this long for its job here (holding the worker slot):
        a short job's end is then seen at once and its task ends without the round trip through the triggerer
        (about 3 s). 0 defers at once.
    :param stall_timeout_s: the stall watch (0: off; templated, like ``stall_floor_s``, ``stall_factor`` and
        ``stall_warm_up_steps``): the ranks write heartbeats into ``heartbeat_dir`` (templated;
        jobs/hybridtrain/heartbeat.py) and the trigger reads them. Each rank has a progress deadline: in training,
        past its warm-up steps, ``max(stall_floor_s, stall_factor x its median step time)``, else this
        (:class:`~hybridflow.utils.stalls.StallWatch`). Ranks past their deadlines: the stopped ranks' Python stacks
        (``py_spy`` on the cluster, through ``srun --overlap``) go into the job's log and an on-call alert, and the
        job is requeued to resume from its checkpoint, at most ``max_stall_restarts`` times; then it is cancelled
        and the task fails. Deferrable mode only.
    :param failure_classes: what a failed job's end means (:class:`~hybridflow.config.FailureClass` rows, first
        match wins): requeue the same job, let Airflow retry, or fail at once; default the pipeline config's
        ``recovery.failure_classes``. The task's log, its error and its XCom name the class.
    :param hide_gpus_without_gres: a job that asks for no GPU (``gpus_per_node`` 0) exports
        ``CUDA_VISIBLE_DEVICES=''``, so it runs on its CPUs even on a node whose GPUs Slurm does not fence
        (``ConstrainDevices``): the CPU placement of training and evaluation.

    ``max_requeues`` and ``poll_interval_s`` default to the pipeline config's
    (:class:`~hybridflow.config.ClusterConfig`).
    """

    template_fields: Sequence[str] = ("command", "partition", "log_dir", "progress_path", "env", "time_limit",
                                      "nodes", "gpus_per_node", "ranks_per_node", "heartbeat_dir", "stall_timeout_s",
                                      "stall_floor_s", "stall_factor", "stall_warm_up_steps")
    template_fields_renderers = {"env": "json"}
    ui_color = "#d9e7ff"
    operator_extra_links = (SlurmJobLink(),)

    def __init__(
        self,
        *,
        command: Sequence[str],
        partition: str,
        log_dir: str,
        ssh_conn_id: str = "slurm_ssh",
        nodes: int | str = 1,
        gpus_per_node: int | str = 0,
        ranks_per_node: int | str = 0,
        gpu_type: str | None = None,
        cpus_per_task: int = 1,
        mem: str | None = None,
        time_limit: int | str = 60,
        account: str | None = None,
        qos: str | None = None,
        constraint: str | None = None,
        signal: str | None = "USR2@90",
        requeue: bool = True,
        max_requeues: int = ClusterConfig.max_requeues,
        env: Mapping[str, str] | None = None,
        setup_lines: Sequence[str] = (),
        progress_path: str = "",
        poll_interval_s: float = ClusterConfig.poll_interval_s,
        reconnect_budget_s: float = ClusterConfig.reconnect_budget_s,
        log_tail_lines: int = 40,
        runbook: str = DEFAULT_RUNBOOK,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        wait_before_defer_s: float = 20.0,
        hide_gpus_without_gres: bool = False,
        stall_timeout_s: float | str = 0.0,
        stall_floor_s: float | str = RecoveryConfig.stall_floor_s,
        stall_factor: float | str = RecoveryConfig.stall_factor,
        stall_warm_up_steps: int | str = RecoveryConfig.stall_warm_up_steps,
        max_stall_restarts: int = RecoveryConfig.max_stall_restarts,
        heartbeat_dir: str = "",
        py_spy: str = "",
        failure_classes: Mapping[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.command = list(command)
        self.partition = partition
        self.log_dir = log_dir
        self.ssh_conn_id = ssh_conn_id
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.ranks_per_node = ranks_per_node
        self.gpu_type = gpu_type
        self.cpus_per_task = cpus_per_task
        self.mem = mem
        self.time_limit = time_limit
        self.account = account
        self.qos = qos
        self.constraint = constraint
        self.signal = signal
        self.requeue = requeue
        self.max_requeues = max_requeues
        self.env = dict(env or {})
        self.setup_lines = tuple(setup_lines)
        self.progress_path = progress_path
        self.poll_interval_s = poll_interval_s
        self.reconnect_budget_s = reconnect_budget_s
        self.log_tail_lines = log_tail_lines
        self.runbook = runbook
        self.deferrable = deferrable
        self.wait_before_defer_s = wait_before_defer_s
        self.hide_gpus_without_gres = hide_gpus_without_gres
        self.stall_timeout_s = stall_timeout_s
        self.stall_floor_s = stall_floor_s
        self.stall_factor = stall_factor
        self.stall_warm_up_steps = stall_warm_up_steps
        self.max_stall_restarts = max_stall_restarts
        self.heartbeat_dir = heartbeat_dir
        self.py_spy = py_spy
        self._failure_classes = failure_classes
        self.job_id: str | None = None
        self._context: Context | None = None

    @property
    def placement_side(self) -> str:
        """``"cpu"`` for a job that asks for no GPU, else ``"gpu"``."""
        return "gpu" if whole_number(self.gpus_per_node, "gpus_per_node") else "cpu"

    @property
    def stall_watch(self) -> StallWatch | None:
        """The stall watch's settings (rendered: the one conversion of the templated fields), None when off."""
        from hybridflow.utils.stalls import StallWatch

        return StallWatch.from_settings({"stall_timeout_s": self.stall_timeout_s, "stall_floor_s": self.stall_floor_s,
                                         "stall_factor": self.stall_factor,
                                         "stall_warm_up_steps": self.stall_warm_up_steps})

    @cached_property
    def hook(self) -> SlurmHook:
        from hybridflow.hooks.slurm import SlurmHook

        return SlurmHook(self.ssh_conn_id)

    def job_key(self, context: Context) -> SlurmJobKey:
        """The task instance this job runs for; it makes the job's name and comment."""
        from hybridflow.config import pipeline_config
        from hybridflow.utils.slurm_jobs import SlurmJobKey

        ti = context["ti"]
        return SlurmJobKey(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=ti.map_index,
                           deployment=pipeline_config().reconciler.deployment)

    def job_name(self, context: Context) -> str:
        return self.job_key(context).job_name

    def node_self_check(self) -> tuple[str, ...]:
        """argv of the check each node runs before the command (none here; training has one)."""
        return ()

    def build_spec(self, name: str, comment: str | None = None):
        from hybridflow.utils.slurm import SlurmJobSpec

        time_limit = int(self.time_limit) if str(self.time_limit).isdigit() else self.time_limit
        env = self.env
        if self.hide_gpus_without_gres and self.placement_side == "cpu":
            env = {"CUDA_VISIBLE_DEVICES": "", **self.env}
        return SlurmJobSpec(
            job_name=name, partition=self.partition, command=self.command, nodes=whole_number(self.nodes, "nodes"),
            gpus_per_node=whole_number(self.gpus_per_node, "gpus_per_node"),
            ranks_per_node=whole_number(self.ranks_per_node, "ranks_per_node"), gpu_type=self.gpu_type,
            cpus_per_task=self.cpus_per_task,
            mem=self.mem, time_limit=time_limit, account=self.account, qos=self.qos, constraint=self.constraint,
            signal=self.signal, requeue=self.requeue, output=f"{self.log_dir}/%x-%j.out",
            error=f"{self.log_dir}/%x-%j.err", comment=comment, setup_lines=self.setup_lines, env=env,
            node_check=self.node_self_check(), end_marker_dir=self.log_dir,
        )

    def execute(self, context: Context) -> dict:
        from dataclasses import replace

        from hybridflow.utils.failures import excluded_nodes
        from hybridflow.utils.slurm import render_sbatch_script
        from hybridflow.utils.slurm_jobs import job_to_reattach

        self._context = context
        key = self.job_key(context)
        name = key.job_name
        spec = self.build_spec(name, key.comment())  # validates every field before anything touches the cluster
        existing = job_to_reattach(self.hook.find_by_name(name), self.requeue)
        if existing is None and (exclude := excluded_nodes(self._recovery_records())):
            spec = replace(spec, exclude=tuple(exclude))  # a node this task excluded before stays out
        if existing is not None:
            self.log.info("Reattaching to Slurm job %s (%s, %s) instead of submitting again", existing.job_id,
                          name, existing.state)
            self.job_id = existing.job_id
        else:
            if spec.ranks_per_node and spec.gpus_per_node:
                self._refuse_impossible_shape(spec)
            self.hook.run(["mkdir", "-p", "--", self.log_dir])
            self.job_id = self.hook.submit(render_sbatch_script(spec))
            self.log.info("Submitted Slurm job %s (%s) to partition %s (%s)", self.job_id, name, self.partition,
                          f"{spec.gpus_per_node} GPU(s) per node" if spec.gpus_per_node else "no GPU")
        context["ti"].xcom_push(key=XCOM_JOB_ID, value=self.job_id)

        if existing is not None and existing.final(self.requeue):
            return self._finish(existing)
        return self._follow()

    def _follow(self) -> dict:
        """Wait for the job: here for ``wait_before_defer_s``, then deferred (the trigger); or here to its end,
        holding the worker slot."""
        if not self.deferrable:
            return self._finish(self._wait_here())
        ended = self._wait_here(self.wait_before_defer_s) if self.wait_before_defer_s > 0 else None
        if ended is not None:
            return self._finish(ended)
        self.defer(trigger=self._trigger(), method_name="execute_complete",
                   timeout=self.execution_timeout or timedelta(days=7))

    def _refuse_impossible_shape(self, spec) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        verdict = self.hook.capacity(spec.partition, spec.gpus_per_node, spec.nodes)
        if verdict.impossible:
            raise AirflowFailException(f"not submitted: {verdict.reason}. Runbook: {self.runbook}")

    def _trigger(self):
        from hybridflow.triggers.slurm import SlurmJobTrigger

        watch = self.stall_watch
        stall = {} if watch is None else {
            "heartbeat_dir": self.heartbeat_dir, "stall_timeout_s": watch.timeout_s, "stall_floor_s": watch.floor_s,
            "stall_factor": watch.factor, "stall_warm_up_steps": watch.warm_up_steps}
        return SlurmJobTrigger(
            job_id=self.job_id, ssh_conn_id=self.ssh_conn_id, requeue_enabled=self.requeue,
            max_requeues=self.max_requeues, poll_interval_s=self.poll_interval_s,
            reconnect_budget_s=self.reconnect_budget_s, progress_path=self.progress_path, **stall,
            world_size=whole_number(self.nodes, "nodes") * max(whole_number(self.ranks_per_node, "ranks_per_node"), 1),
            end_marker_dir=self.log_dir, recovery_log=self._recovery_log(),
            log_lines=self._recovery_config.log_lines, log_tail_lines=self.log_tail_lines,
        )

    def _wait_here(self, for_s: float | None = None) -> SlurmJobStatus | None:
        """The job's final status, waited for here as the trigger waits (:class:`EndWatch`), holding this worker
        slot; None when it has not ended within ``for_s`` seconds (None: no limit)."""
        from hybridflow.utils.slurm_jobs import EndWatch

        deadline = None if for_s is None else time.monotonic() + for_s
        watch = EndWatch(self.log_dir, self.poll_interval_s, min_s=0.5)
        while True:
            status = self.hook.status(self.job_id)
            if status is not None and status.final(self.requeue):
                return status
            left = float("inf") if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            wait = watch.next_wait(status)
            if not wait.marker:
                time.sleep(min(wait.seconds, left))
            elif self.hook.wait_for_file(wait.marker, min(wait.seconds, left)):
                watch.marker_seen(status)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        from hybridflow.utils.slurm_jobs import SlurmJobStatus

        missing = {"status", "job_id"} - set(event)
        if missing:
            raise SlurmJobFailed(f"malformed trigger event (missing {sorted(missing)}): {event}")
        self.job_id = event["job_id"]
        if event["status"] == "error":
            raise SlurmConnectionError(f"{event.get('message', 'trigger failed')}. Runbook: {self.runbook}")
        self._context = context
        if event["status"] == "stalled":
            from hybridflow.utils.stalls import Stall

            return self._heal_stall(SlurmJobStatus.from_event(event), Stall.from_event(event["stall"]))
        return self._finish(SlurmJobStatus.from_event(event), event.get("message", ""), event.get("handback"))

    def _finish(self, status: SlurmJobStatus, message: str = "", handback: Mapping[str, Any] | None = None) -> dict:
        """The task's end for a job that ended: its result, a requeue or resubmission, or its failure.
        ``handback``: what the trigger read for a job that succeeded (log tail, recovery records)."""
        if status.succeeded:
            tail = handback["log_tail"] if handback else self._readable_log(status)[1]
            self.log.info("Slurm job %s COMPLETED in %.0f s (TRES %s); its log:\n%s", status.job_id,
                          status.elapsed_s or 0, dict(status.alloc_tres), tail)
            return {**status.to_event(), "recovery": handback["recovery"] if handback else self._recovery_records(),
                    "efficiency": self._efficiency(status)}
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.utils.failures import classify

        err_path = status.stderr_path or status.stdout_path
        log_text, tail = self._readable_log(status)
        verdict = classify(self.failure_classes, state=status.state, exit_code=status.exit_code,
                           signal=status.exit_signal, log_text=log_text)
        ended = (f"Slurm job {status.job_id} ({status.name}) ended {status.state} with exit code "
                 f"{status.exit_code}:{status.exit_signal} after {status.elapsed_s or 0:.0f} s: {verdict.describe()}.")
        if verdict.action == "requeue":
            why_not = self._cannot_requeue(status)
            if why_not is None:
                self._requeue(status, {"kind": "requeue", "class": verdict.name})
                self.log.warning("%s Requeued (restart %d of max_requeues=%d): it resumes from its checkpoint",
                                 ended, status.restarts + 1, self.max_requeues)
                return self._follow()
            ended += f" Not requeued: {why_not}."
        if verdict.action == "exclude_node":
            why_not = self._resubmit_without_node(status, log_text, ended)
            if why_not is None:
                return self._follow()
            ended += f" Not resubmitted: {why_not}."
        self._efficiency(status)
        text = (f"{ended} {message}\nLast lines of {err_path or 'its log'}:\n{tail}\n"
                f"Runbook: include/runbooks/{verdict.runbook}")
        if verdict.action == "fail":
            raise AirflowFailException(text)
        raise SlurmJobFailed(text)

    def _efficiency(self, status: SlurmJobStatus) -> dict:
        """The ended job's efficiency from Slurm's accounting, logged and in the XCom ``efficiency``. A report, never
        the task's outcome: accounting that cannot be read makes every figure not measured, saying why."""
        from hybridflow.utils.efficiency import describe_efficiency

        try:
            figures = self.hook.efficiency(status.job_id)
        except Exception as error:  # noqa: BLE001 - SSH, parse or accounting errors alike: the job's outcome stands
            figures = {"job_id": status.job_id, "not_measured": {"all": f"Slurm accounting was not read: {error}"}}
        self.log.info("Slurm job %s efficiency: %s", status.job_id, describe_efficiency(figures))
        if self._context is not None:
            self._context["ti"].xcom_push(key=XCOM_EFFICIENCY, value=figures)
        return figures

    def _readable_log(self, status: SlurmJobStatus) -> tuple[str, str]:
        """The last lines of the job's stderr and stdout (``recovery.log_lines`` each), as searched text and as
        the tail on-call reads (the job's errors first, known library noise left out)."""
        from hybridflow.utils.job_logs import log_paths, parse_tails, readable_logs, tails_argv

        paths = log_paths(status.stderr_path, status.stdout_path)
        tails = parse_tails(self.hook.run(tails_argv(paths, self._recovery_config.log_lines)).stdout) if paths else {}
        return readable_logs(paths, tails, self.log_tail_lines)

    # --- healing: the failure classes and the stall watch ---------------------------------------------------

    @cached_property
    def _recovery_config(self) -> RecoveryConfig:
        from hybridflow.config import pipeline_config

        return pipeline_config().recovery

    @property
    def failure_classes(self) -> Mapping[str, Any]:
        return self._recovery_config.failure_classes if self._failure_classes is None else self._failure_classes

    def _cannot_requeue(self, status: SlurmJobStatus) -> str | None:
        if not self.requeue:
            return "the job was submitted with requeue=False"
        if status.restarts >= self.max_requeues:
            return f"it restarted {status.restarts} times already (max_requeues={self.max_requeues})"
        return None

    def _recovery_log(self) -> str:
        from hybridflow.utils.failures import recovery_log_path

        return recovery_log_path(self.log_dir, self.job_name(self._context))

    def _recovery_records(self) -> list[dict]:
        """What was done to heal this task's jobs (every job of its name), from the recovery log."""
        from hybridflow.utils.failures import parse_recovery_log

        if self._context is None:
            return []
        return parse_recovery_log(self.hook.read_text(self._recovery_log()))

    def _append(self, path: str, text: str) -> None:
        """Append ``text`` to a file on the cluster (the path is an argument, the text goes on stdin)."""
        result = self.hook.run(["sh", "-c", 'cat >> "$1"', "sh", path], stdin=text)
        if result.returncode != 0:
            self.log.warning("could not append to %s: %s", path, result.stderr.strip())

    def _requeue(self, status: SlurmJobStatus, record: Mapping[str, Any]) -> None:
        """``scontrol requeue`` (a running or a finished job: Slurm queues the same job id again) and a line in
        the recovery log."""
        from datetime import UTC, datetime

        from hybridflow.utils.failures import recovery_line

        result = self.hook.run(["scontrol", "requeue", status.job_id])
        if result.returncode != 0:
            raise SlurmJobFailed(f"scontrol requeue {status.job_id} failed: {result.stderr.strip()}. "
                                 f"Runbook: {self.runbook}")
        self._append(self._recovery_log(), recovery_line({
            **record, "job_id": status.job_id, "restart": status.restarts + 1, "state": status.state,
            "at": datetime.now(UTC).isoformat(timespec="seconds")}))

    def _resubmit_without_node(self, status: SlurmJobStatus, log_text: str, ended: str) -> str | None:
        """A node failed its self-check: submit once more without it (the alert names the node and the check).
        Returns None when resubmitted (``self.job_id`` is the new job), else why not."""
        from dataclasses import replace
        from datetime import UTC, datetime

        from hybridflow.notifiers.oncall import UNHEALTHY_NODE
        from hybridflow.utils.failures import excluded_nodes, recovery_line, unhealthy_node
        from hybridflow.utils.slurm import render_sbatch_script

        found = unhealthy_node(log_text, status.exit_code)
        if found is None:
            return "the job's log names no node"
        records = self._recovery_records()
        if excluded_nodes(records):
            return f"this task excluded {', '.join(excluded_nodes(records))} already (one resubmission)"
        node, check, detail = found
        key = self.job_key(self._context)
        spec = replace(self.build_spec(key.job_name, key.comment()), exclude=(node,))
        if spec.gpus_per_node or spec.nodes > 1:
            verdict = self.hook.capacity(spec.partition, spec.gpus_per_node, spec.nodes, exclude=[node])
            if verdict.impossible:
                return f"without {node}: {verdict.reason}"
        self._append(self._recovery_log(), recovery_line({
            "kind": "exclude_node", "node": node, "check": check, "detail": detail, "job_id": status.job_id,
            "at": datetime.now(UTC).isoformat(timespec="seconds")}))
        self.job_id = self.hook.submit(render_sbatch_script(spec))
        self._context["ti"].xcom_push(key=XCOM_JOB_ID, value=self.job_id)
        what = (f"node {node} failed its self-check ({check}: {detail}); Slurm job {status.job_id} ended, "
                f"job {self.job_id} submitted without {node}")
        self.log.warning("%s %s", ended, what)
        self._alert(UNHEALTHY_NODE, what, "\n".join(line for line in log_text.splitlines() if "node check" in
                                                   line.lower() or "srun: error" in line) or log_text[-2000:])
        return None

    def _heal_stall(self, status: SlurmJobStatus, stall) -> dict:
        """A stalled job: the stopped ranks' stacks into the job's log and the alert; requeue, or cancel and fail
        once ``max_stall_restarts`` is spent."""
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.notifiers.oncall import STALL
        from hybridflow.utils.stalls import stall_count, stall_report

        detected_at = time.time()
        earlier = stall_count(self._recovery_records(), status.job_id)
        why_not = self._cannot_requeue(status)
        if earlier >= self.max_stall_restarts:
            why_not = f"it stalled {earlier} time(s) before (max_stall_restarts={self.max_stall_restarts})"
        action = (f"cancelled: {why_not}" if why_not else
                  f"requeued to resume from its newest checkpoint (stall restart {earlier + 1} of "
                  f"{self.max_stall_restarts})")
        stacks = {rank.rank: self._stack(status.job_id, rank) for rank in stall.ranks}
        report = stall_report(stall, stacks, action)
        self.log.error("%s", report)
        self._append(status.stderr_path or status.stdout_path, f"\n{report}\n")
        if why_not:
            self.hook.cancel(status.job_id)
            raise AirflowFailException(f"Slurm job {status.job_id} stalled: {stall.summary()}; {action}. "
                                       f"Runbook: include/runbooks/training.md#stall\n{report}")
        self._requeue(status, {"kind": "stall", "stall": stall.to_event(), "detected_at": round(detected_at, 3)})
        self._alert(STALL, f"Slurm job {status.job_id} stalled: {stall.summary()}; {action}", report)
        return self._follow()

    def _stack(self, job_id: str, rank) -> str:
        """A stopped rank's Python stack (its main thread's innermost frames), or why there is none."""
        from hybridflow.utils.stalls import py_spy_argv, top_frames

        if not self.py_spy:
            return "(not captured: no py_spy configured for this task)"
        if rank.pid is None or not rank.node:
            return "(not captured: the rank never reported its process)"
        try:
            result = self.hook.run(py_spy_argv(self.py_spy, job_id, rank), timeout_s=90)
        except Exception as exc:  # noqa: BLE001 (best effort: the requeue matters more than the stack)
            return f"(not captured: {exc})"
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[0]
            return f"(not captured: py-spy exit {result.returncode}: {last})"
        return top_frames(result.stdout)

    def _alert(self, kind: str, what: str, details: str) -> None:
        """An on-call alert about something this task did (best effort: never fails the task)."""
        from hybridflow.config import pipeline_config
        from hybridflow.notifiers.oncall import send_task_alert

        try:
            send_task_alert(self._context["ti"], pipeline_config().alerts, kind=kind, error=what, details=details,
                            job_id=self.job_id)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("could not send the on-call alert (%s): %s", exc, what)

    def on_kill(self) -> None:
        if self.job_id:
            status = self.hook.cancel(self.job_id)
            self.log.info("Cancelled Slurm job %s on kill: now %s", self.job_id, status.state if status else "gone")
