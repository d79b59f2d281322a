"""The suite in lanes: test files that cannot disturb each other run at the same time, on the one local stack.

Most of the suite's time is waiting (a Slurm job, Airflow's scheduler, a person's answer held for 20 s), so two
pytest processes on 2 cores finish sooner than one. Three groups:

- ``serving``: Triton and the MLflow registry through in-process DAG runs, the training job on this machine, unit
  and DAG tests; no Slurm job, no Spark app, no run of the stack's Airflow, nothing taken down.
- ``cluster``: every other integration, e2e and browser test (Slurm, Spark, the nightly end to end, and every test
  that runs DAGs on the stack's Airflow: one scheduler, 4 executor slots); runs beside ``serving``.
- ``alone``: what takes services down, kills Airflow's components or fills the GPU pool (the reliability tests, the
  stack's own restart and MLflow's down/up); runs after both, with nothing beside it.

A new test file lands in ``cluster`` unless listed, or in ``alone`` when under tests/reliability.

    python scripts/test_lanes.py [pytest arguments...]

Each lane's output goes to ``<state>/test-lanes/<lane>.log`` and is printed when the lane ends; ``--junitxml=F``
becomes ``F`` with the lane's name before its suffix. Exits non-zero when any lane failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from stack.common import REPO, STATE  # scripts/ is on sys.path: this script's own folder

ALONE = ("tests/reliability/", "tests/integration/test_stack_smoke.py", "tests/integration/test_mlflow_server.py")
SERVING = (
    "tests/unit/", "tests/dags/",
    "tests/integration/test_model_registry.py",
    "tests/integration/test_triton_deploy.py", "tests/integration/test_triton_release.py",
    "tests/integration/test_training_job.py",  # the training job on this machine's cores: no Slurm, no Spark
)
LANES = ("serving", "cluster", "alone")


def lane_of(test_file: str) -> str:
    """The lane of one test file, a path relative to the repository."""
    if test_file.startswith(ALONE):
        return "alone"
    return "serving" if test_file.startswith(SERVING) else "cluster"


def plan(test_files: list[str]) -> dict[str, list[str]]:
    """Every test file in exactly one lane, in the order given."""
    lanes: dict[str, list[str]] = {lane: [] for lane in LANES}
    for test_file in test_files:
        lanes[lane_of(test_file)].append(test_file)
    return lanes


def lane_args(args: list[str], lane: str) -> list[str]:
    """The pytest arguments of one lane: a report file of its own (``--junitxml=ci.xml`` -> ``ci.serving.xml``)."""
    out = []
    for arg in args:
        if arg.startswith("--junitxml="):
            path = Path(arg.removeprefix("--junitxml="))
            arg = f"--junitxml={path.with_name(f'{path.stem}.{lane}{path.suffix}')}"
        out.append(arg)
    return out


def test_files() -> list[str]:
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py"))


def _pytest(files: list[str], args: list[str], lane: str) -> list[str]:
    # pytest's own numbered temp folders (one per session, locked while in use) keep the lanes' files apart
    return [sys.executable, "-m", "pytest", *files, *lane_args(args, lane)]


def main(args: list[str]) -> int:
    lanes = plan(test_files())
    log_dir = STATE / "test-lanes"
    log_dir.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    started = time.monotonic()
    running = {}
    for lane in ("serving", "cluster"):
        log = open(log_dir / f"{lane}.log", "wb")  # noqa: SIM115 - closed when the lane ends
        running[lane] = (subprocess.Popen(_pytest(lanes[lane], args, lane), cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT), log)
        print(f"[lanes] {lane}: {len(lanes[lane])} files, log {log_dir / lane}.log", flush=True)
    while running:
        time.sleep(5)
        for lane, (process, log) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            codes[lane] = process.returncode
            del running[lane]
            print(f"\n[lanes] ===== {lane}: exit {process.returncode} after {time.monotonic() - started:.0f} s",
                  flush=True)
            sys.stdout.write((log_dir / f"{lane}.log").read_text(errors="replace"))
            sys.stdout.flush()
    print(f"\n[lanes] ===== alone: {len(lanes['alone'])} files, nothing beside them", flush=True)
    codes["alone"] = subprocess.run(_pytest(lanes["alone"], args, "alone"), cwd=REPO).returncode
    print(f"\n[lanes] exit codes {codes}, {time.monotonic() - started:.0f} s in all", flush=True)
    failed = [code for code in codes.values() if code != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
