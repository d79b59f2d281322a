"""The suite in lanes: tests that cannot disturb each other run at the same time, on the one local stack.

Most of the suite's time is waiting (a Slurm job, Airflow's scheduler, a person's answer held for 20 s): one pytest
process keeps about half of the 2 cores busy, so lanes side by side finish sooner than one. Three phases, one after
the other; the lanes of a phase run side by side, and no lane takes down what a lane beside it uses:

- ``users``: tests that use the shared services (Slurm over sshd, Airflow's components, PostgreSQL, MLflow, S3,
  Triton, Spark) and take none of them down.
- ``crashes``: what crashes Slurm (a node, slurmctld, every GPU taken) or Airflow's control plane, one after another
  (the nightly end to end kills the control plane itself), beside tests that use none of those (a private Airflow
  with a PostgreSQL of its own, Spark, the training job on this machine's cores).
- ``outages``: sshd, Airflow's triggerer and MLflow taken down, Airflow's slots filled, beside Triton taken down (no
  test beside it uses Triton).

A lane is a list of pytest node id prefixes: a folder, a file, or one test of a file (``file::test``: it runs in
that lane and is deselected from its file's). A test file no lane names runs in ``control-plane``: beside it only
tests that use no service a new test could take down, and none it could need.

    python scripts/test_lanes.py [pytest arguments...]

Each lane's output goes to ``<state>/test-lanes/<lane>.log`` and is printed when the lane ends; ``--junitxml=F``
becomes ``F`` with the lane's name before its suffix. Exits non-zero when any lane failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from stack.common import REPO, STATE  # scripts/ is on sys.path: this script's own folder

AIRFLOW_SLURM_FAULTS = "tests/reliability/test_airflow_slurm_faults.py"
HEALS = "tests/integration/test_training_heals_itself.py"
PHASES: dict[str, dict[str, tuple[str, ...]]] = {
    "users": {
        "triton": (
            "tests/integration/test_triton_deploy.py", "tests/integration/test_triton_release.py",
            "tests/integration/test_model_registry.py", "tests/integration/test_release_approval.py",
            "tests/integration/test_workload_router.py",  # its realtime route deploys to Triton
        ),
        "training": (
            "tests/integration/test_training_tracking.py", "tests/integration/test_training_on_slurm.py",
            "tests/integration/test_distributed_training_on_slurm.py",
            "tests/integration/test_oncall_training_job.py", "tests/integration/test_retrain_generation.py",
            "tests/integration/test_router_gpu_scoring.py",
            f"{HEALS}::test_a_data_error_fails_at_once_without_a_requeue_or_a_retry",
            "tests/integration/test_stack_smoke.py",
        ),
        "airflow": (
            "tests/unit/", "tests/dags/",
            "tests/browser/", "tests/e2e/test_failure_alerts.py",
            "tests/integration/test_slurm_operator.py", "tests/integration/test_slurm_reconciler.py",
            "tests/integration/test_run_deadline.py", "tests/integration/test_ui_pages.py",
            "tests/integration/test_params_api.py", "tests/integration/test_ssh_host_keys.py",
            "tests/reliability/test_security.py",
            AIRFLOW_SLURM_FAULTS,  # its own task's faults; the shared services' are outages
        ),
    },
    "crashes": {
        "control-plane": (
            "tests/e2e/test_nightly_pipeline.py",  # SIGKILLs Airflow's components, slurmctld and PostgreSQL
            HEALS,  # a node fails its self-check, a node dies, a rank stalls
            "tests/integration/test_utilization_ledger.py",  # drains a node
            "tests/integration/test_slurm_gates.py",  # takes every GPU of the partition
        ),
        "local": (
            "tests/integration/test_backfill_never_starts_a_night.py",  # an Airflow and a PostgreSQL of its own
            "tests/integration/test_spark_stages.py", "tests/reliability/test_data_faults.py",
            "tests/integration/test_nightly_on_object_store.py",  # a Spark job and an Airflow of its own, on S3
            "tests/integration/test_training_job.py",  # on this machine's cores: no service at all
            # DeepSpeed trainings in process (2 ranks each): beside the users' latency gates they took both cores.
            # Beside the outages instead (2026-12-07, CI): Triton's outage tests took 610 s from 313, the outages
            # phase 611 s from 448, and the crashes phase did not shorten (its control-plane lane 935 s).
            "tests/unit/jobs/hybridtrain/test_train_host_syncs.py",
            "tests/unit/jobs/hybridtrain/test_train_in_process.py",
        ),
    },
    "outages": {
        "ssh-airflow-mlflow": (
            f"{AIRFLOW_SLURM_FAULTS}::test_triggerer_restart_while_deferred_resumes_and_the_task_succeeds_on_the_same_job",
            f"{AIRFLOW_SLURM_FAULTS}::test_sshd_down_30s_while_deferred_the_trigger_reconnects_and_the_task_succeeds",
            f"{AIRFLOW_SLURM_FAULTS}::test_sshd_down_past_the_reconnect_budget_fails_clearly_and_a_rerun_reattaches",
            "tests/reliability/test_load.py",  # fills Airflow's executor slots and the GPU pool
            "tests/integration/test_mlflow_server.py",  # takes MLflow down and up
        ),
        "triton-outages": (
            "tests/reliability/test_triton_faults.py",  # takes Triton down
            "tests/reliability/test_triton_hostile_requests.py",  # kills tritonserver under load
        ),
    },
}
LANES = tuple(lane for lanes in PHASES.values() for lane in lanes)
UNLISTED_LANE = "control-plane"
NO_TESTS_COLLECTED = 5  # pytest's exit code
DIGEST_LINES = 40  # of each failure, printed again after every lane has ended


def covers(prefix: str, test_id: str) -> bool:
    """Whether a lane's entry (a folder ending in ``/``, a file or ``file::test``) holds a file or test."""
    return test_id == prefix or prefix.endswith("/") and test_id.startswith(prefix) or test_id.startswith(prefix + "::")


def lane_of(test_id: str) -> str:
    """The lane of one test file or test (a node id relative to the repository): the longest entry that holds it."""
    matches = [(len(prefix), lane) for lanes in PHASES.values() for lane, prefixes in lanes.items()
               for prefix in prefixes if covers(prefix, test_id)]
    return max(matches)[1] if matches else UNLISTED_LANE


def single_tests() -> list[str]:
    """The ``file::test`` entries: tests placed apart from the rest of their file."""
    return [prefix for lanes in PHASES.values() for prefixes in lanes.values() for prefix in prefixes if "::" in prefix]


def plan(test_files: list[str]) -> dict[str, list[str]]:
    """Each lane's pytest selection: its files, the single tests placed in it, and ``--deselect`` for the tests of
    its files placed elsewhere. Every test of the given files lands in exactly one lane."""
    lanes: dict[str, list[str]] = {lane: [] for lane in LANES}
    for test_file in test_files:
        lanes[lane_of(test_file)].append(test_file)
    for test_id in single_tests():
        test_file = test_id.split("::")[0]
        home, lane = lane_of(test_file), lane_of(test_id)
        if test_file in test_files and home != lane:
            lanes[lane].append(test_id)
            lanes[home].append(f"--deselect={test_id}")
    return lanes


def lane_args(args: list[str], lane: str) -> list[str]:
    """The pytest arguments of one lane: a report file of its own (``--junitxml=ci.xml`` -> ``ci.triton.xml``)."""
    out = []
    for arg in args:
        if arg.startswith("--junitxml="):
            path = Path(arg.removeprefix("--junitxml="))
            arg = f"--junitxml={path.with_name(f'{path.stem}.{lane}{path.suffix}')}"
        out.append(arg)
    return out


def test_files() -> list[str]:
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py"))


def _pytest(selection: list[str], args: list[str], lane: str) -> list[str]:
    # pytest's own numbered temp folders (one per session, locked while in use) keep the lanes' files apart
    return [sys.executable, "-m", "pytest", *selection, *lane_args(args, lane)]


def run_phase(phase: str, lanes: dict[str, list[str]], args: list[str], log_dir: Path, started: float) -> dict:
    """Brings the stack up (what a fault left down), then runs the phase's lanes side by side; prints each lane's
    output as it ends. Their exit codes, by lane."""
    up = subprocess.run([sys.executable, str(REPO / "scripts" / "localstack.py"), "up"], cwd=REPO,
                        capture_output=True, text=True)
    if up.returncode != 0:
        print(f"[lanes] {phase}: the stack did not come up:\n{up.stdout}\n{up.stderr}", flush=True)
        return {phase: up.returncode}
    # The lanes' sessions bring nothing up themselves (tests/conftest.py's stack fixture): one lane's up could
    # restart a service another lane's test took down on purpose.
    env = dict(os.environ, HYBRIDFLOW_STACK_UP_BY_LANES="1")
    running, codes, cpu = {}, {}, CpuTally()
    for lane in PHASES[phase]:
        if not lanes[lane]:
            continue
        log = open(log_dir / f"{lane}.log", "wb")  # noqa: SIM115 - closed when the lane ends
        running[lane] = (subprocess.Popen(_pytest(lanes[lane], args, lane), cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT), log)
        files = sum(not item.startswith("--") for item in lanes[lane])
        print(f"[lanes] {phase}/{lane}: {files} files or tests, log {log_dir / lane}.log", flush=True)
    while running:
        time.sleep(2)
        cpu.sample()
        for lane, (process, log) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            codes[lane] = process.returncode
            del running[lane]
            print(f"\n[lanes] ===== {phase}/{lane}: exit {process.returncode} at {time.monotonic() - started:.0f} s",
                  flush=True)
            sys.stdout.write((log_dir / f"{lane}.log").read_text(errors="replace"))
            sys.stdout.flush()
    print(f"[lanes] {phase}: {cpu.report()}", flush=True)
    return codes


def process_cpu() -> dict[int, tuple[float, str]]:
    """CPU seconds (user + system) of every live process, by pid, with :func:`command_label`."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / ticks,
                                  command_label(argv) or stat[stat.index("(") + 1:stat.rindex(")")])
    return found


def command_label(argv: list[str]) -> str:
    """A process's program and what it runs, without paths, options or per-process details: ``python pytest``,
    ``java Worker``, ``postgres: airflow``."""
    words = [word for word in argv if word]
    if len(words) == 1:  # a title the process set itself (postgres, airflow's api_server)
        words = words[0].split()
    if not words:
        return ""
    program, rest = Path(words[0]).name, [w for w in words[1:] if not w.startswith("-")]
    main_class = [w.rsplit(".", 1)[-1] for w in rest if w.startswith("org.apache.")]
    names = [Path(word).name.splitlines()[0] if word.strip() else "" for word in rest]
    if program == "java" and main_class:
        names = main_class[-1:]
    elif program.startswith("python") and names[:1] != ["pytest"]:  # python airflow scheduler
        names = names[:2]
    else:
        names = names[:1]
    return " ".join([program, *names])[:60]


class CpuTally:
    """Where a phase's CPU went, sampled every few seconds (processes shorter than a sample are missed): the
    machine's busy cores on average and the commands that used most. The suite's lanes share 2 cores, so this
    says what a slow phase waited for."""

    def __init__(self):
        self.started, self.busy_at_start = time.monotonic(), _busy_seconds()
        self.last, self.by_command = process_cpu(), {}

    def sample(self) -> None:
        now = process_cpu()
        for pid, (seconds, command) in now.items():
            before = self.last.get(pid, (0.0, command))[0]
            self.by_command[command] = self.by_command.get(command, 0.0) + max(0.0, seconds - before)
        self.last = now

    def report(self, top: int = 12) -> str:
        wall = time.monotonic() - self.started
        busy = (_busy_seconds() - self.busy_at_start) / wall
        leaders = sorted(self.by_command.items(), key=lambda item: -item[1])[:top]
        return (f"CPU busy {busy:.2f} of {os.cpu_count()} cores over {wall:.0f} s; most CPU-seconds: "
                + "; ".join(f"{seconds:.0f} {command}" for command, seconds in leaders))


def _busy_seconds() -> float:
    """The machine's busy CPU seconds since boot (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def main(args: list[str]) -> int:
    lanes = plan(test_files())
    log_dir = STATE / "test-lanes"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    codes: dict[str, int] = {}
    for phase in PHASES:  # every phase runs, whatever the one before it found: CI shows every failure at once
        codes |= run_phase(phase, lanes, args, log_dir, started)
    for lane, code in codes.items():  # again at the end: CI keeps the tail, where a lane's failures were cut
        if code not in (0, NO_TESTS_COLLECTED):
            print(f"\n[lanes] {lane} failed (exit {code}):\n"
                  f"{failure_digest((log_dir / f'{lane}.log').read_text(errors='replace'))}", flush=True)
    print(f"\n[lanes] exit codes {codes}, {time.monotonic() - started:.0f} s in all", flush=True)
    return exit_code(codes)


def failure_digest(log: str, lines_per_failure: int = DIGEST_LINES) -> str:
    """Each failure of a pytest log in its last lines (where the assertion and its message are), then the short
    summary; the whole log when pytest printed no failures section (a crash, a stack that did not come up)."""
    failures = re.search(r"^=+ FAILURES =+$(.*?)(?=^=+ [a-z][^=]* =+$)", log, re.M | re.S)
    summary = re.search(r"^=+ short test summary info =+$(.*)", log, re.M | re.S)
    if not failures:
        return "\n".join(log.splitlines()[-lines_per_failure:])
    parts = re.split(r"^(_+ \S.* _+)$", failures.group(1), flags=re.M)  # a long name leaves "__ name ___"
    digest = []
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        body = re.split(r"^-+ Captured .+ -+$", body, maxsplit=1, flags=re.M)[0]  # the traceback's end, not logs
        body_lines = body.strip("\n").splitlines()
        cut = len(body_lines) - lines_per_failure
        digest += [title, *([f"[... {cut} lines]"] if cut > 0 else []), *body_lines[-lines_per_failure:]]
    if summary:
        digest += [line for line in summary.group(1).splitlines() if line.startswith(("FAILED", "ERROR"))]
    return "\n".join(digest)


def exit_code(codes: dict[str, int]) -> int:
    """The run's exit code from the lanes': the first failure's; pytest's 5 (no test collected, as under ``-k``
    in a lane none of whose tests match) only when no lane collected any."""
    failed = [code for code in codes.values() if code not in (0, NO_TESTS_COLLECTED)]
    if failed:
        return failed[0]
    return NO_TESTS_COLLECTED if codes and all(code == NO_TESTS_COLLECTED for code in codes.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
