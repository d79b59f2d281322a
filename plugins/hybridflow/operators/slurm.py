"""Submit a batch job to a Slurm partition over SSH, exactly once per task, and wait for it deferred."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from hybridflow.config import ClusterConfig
from hybridflow.exceptions import SlurmConnectionError, SlurmJobFailed
from hybridflow.ui import SlurmJobLink

if TYPE_CHECKING:
    from airflow.sdk import Context

    from hybridflow.hooks.slurm import SlurmHook
    from hybridflow.utils.slurm_jobs import SlurmJobKey, SlurmJobStatus

XCOM_JOB_ID = "slurm_job_id"
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
    :param deferrable: wait in the triggerer (default) instead of holding a worker slot.
    :param hide_gpus_without_gres: a job that asks for no GPU (``gpus_per_node`` 0) exports
        ``CUDA_VISIBLE_DEVICES=''``, so it runs on its CPUs even on a node whose GPUs Slurm does not fence
        (``ConstrainDevices``): the CPU placement of training and evaluation.

    ``max_requeues`` and ``poll_interval_s`` default to the pipeline config's
    (:class:`~hybridflow.config.ClusterConfig`).
    """

    template_fields: Sequence[str] = ("command", "partition", "log_dir", "progress_path", "env", "time_limit",
                                      "nodes", "gpus_per_node", "ranks_per_node")
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
        reconnect_budget_s: float = 300.0,
        log_tail_lines: int = 40,
        runbook: str = DEFAULT_RUNBOOK,
        deferrable: bool = True,
        hide_gpus_without_gres: bool = False,
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
        self.hide_gpus_without_gres = hide_gpus_without_gres
        self.job_id: str | None = None

    @property
    def placement_side(self) -> str:
        """``"cpu"`` for a job that asks for no GPU, else ``"gpu"``."""
        return "gpu" if _whole(self.gpus_per_node, "gpus_per_node") else "cpu"

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

    def build_spec(self, name: str, comment: str | None = None):
        from hybridflow.utils.slurm import SlurmJobSpec

        time_limit = int(self.time_limit) if str(self.time_limit).isdigit() else self.time_limit
        env = self.env
        if self.hide_gpus_without_gres and self.placement_side == "cpu":
            env = {"CUDA_VISIBLE_DEVICES": "", **self.env}
        return SlurmJobSpec(
            job_name=name, partition=self.partition, command=self.command, nodes=_whole(self.nodes, "nodes"),
            gpus_per_node=_whole(self.gpus_per_node, "gpus_per_node"),
            ranks_per_node=_whole(self.ranks_per_node, "ranks_per_node"), gpu_type=self.gpu_type,
            cpus_per_task=self.cpus_per_task,
            mem=self.mem, time_limit=time_limit, account=self.account, qos=self.qos, constraint=self.constraint,
            signal=self.signal, requeue=self.requeue, output=f"{self.log_dir}/%x-%j.out",
            error=f"{self.log_dir}/%x-%j.err", comment=comment, setup_lines=self.setup_lines, env=env,
        )

    def execute(self, context: Context) -> dict:
        from hybridflow.utils.slurm import render_sbatch_script
        from hybridflow.utils.slurm_jobs import job_to_reattach

        key = self.job_key(context)
        name = key.job_name
        spec = self.build_spec(name, key.comment())  # validates every field before anything touches the cluster
        existing = job_to_reattach(self.hook.find_by_name(name), self.requeue)
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
        if self.deferrable:
            self.defer(trigger=self._trigger(), method_name="execute_complete",
                       timeout=self.execution_timeout or timedelta(days=7))
        return self._finish(self._wait_here())

    def _refuse_impossible_shape(self, spec) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        verdict = self.hook.capacity(spec.partition, spec.gpus_per_node, spec.nodes)
        if verdict.impossible:
            raise AirflowFailException(f"not submitted: {verdict.reason}. Runbook: {self.runbook}")

    def _trigger(self):
        from hybridflow.triggers.slurm import SlurmJobTrigger

        return SlurmJobTrigger(
            job_id=self.job_id, ssh_conn_id=self.ssh_conn_id, requeue_enabled=self.requeue,
            max_requeues=self.max_requeues, poll_interval_s=self.poll_interval_s,
            reconnect_budget_s=self.reconnect_budget_s, progress_path=self.progress_path,
        )

    def _wait_here(self) -> SlurmJobStatus:
        """Non-deferrable mode: the same backoff as the trigger, holding this worker slot."""
        delay = 1.0
        while True:
            status = self.hook.status(self.job_id)
            if status is not None and status.final(self.requeue):
                return status
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval_s)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        from hybridflow.utils.slurm_jobs import SlurmJobStatus

        missing = {"status", "job_id"} - set(event)
        if missing:
            raise SlurmJobFailed(f"malformed trigger event (missing {sorted(missing)}): {event}")
        self.job_id = event["job_id"]
        if event["status"] == "error":
            raise SlurmConnectionError(f"{event.get('message', 'trigger failed')}. Runbook: {self.runbook}")
        return self._finish(SlurmJobStatus.from_event(event), event.get("message", ""))

    def _finish(self, status: SlurmJobStatus, message: str = "") -> dict:
        if status.succeeded:
            tail = self.hook.tail(status.stdout_path, self.log_tail_lines)
            self.log.info("Slurm job %s COMPLETED in %.0f s (TRES %s); last lines of %s:\n%s", status.job_id,
                          status.elapsed_s or 0, dict(status.alloc_tres), status.stdout_path or "its log", tail)
            return status.to_event()
        err_path = status.stderr_path or status.stdout_path
        tail = self.hook.tail(err_path, self.log_tail_lines) or "(no log found)"
        raise SlurmJobFailed(
            f"Slurm job {status.job_id} ({status.name}) ended {status.state} with exit code "
            f"{status.exit_code}:{status.exit_signal} after {status.elapsed_s or 0:.0f} s. {message}\n"
            f"Last lines of {err_path or 'its log'}:\n{tail}\nRunbook: {self.runbook}"
        )

    def on_kill(self) -> None:
        if self.job_id:
            status = self.hook.cancel(self.job_id)
            self.log.info("Cancelled Slurm job %s on kill: now %s", self.job_id, status.state if status else "gone")


def _whole(value: int | str, name: str) -> int:
    """A rendered template (text) or an int as an int; anything else names the field."""
    from hybridflow.exceptions import InvalidJobSpecError

    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise InvalidJobSpecError(f"{name}={value!r} is invalid: use a whole number")
