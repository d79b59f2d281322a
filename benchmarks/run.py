"""Runs the benchmarks: ``python benchmarks/run.py [NAME ...]`` (all of them when no name is given).

A benchmark is a module ``benchmarks/bench_<name>.py`` with ``main() -> dict`` that prints, as its last line,
``RESULT <name> key=value ...``. Each one runs in its own Python process (a benchmark may start a JVM or pin
threads; the next one starts clean); the runner echoes its output, checks the RESULT line, and writes the
returned dict as JSON to ``benchmarks/results/<name>.json`` (git-ignored). The RESULT line's figures, with the date,
machine and load they were taken at, also go to the checked-in ``benchmarks/figures.json``: the source of the
README's performance table, refreshed by every run. Exit status: 0 when every benchmark succeeded,
1 when one failed, 2 for an unknown name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridflow.atomic import write_json_atomic

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
FIGURES = BENCH_DIR / "figures.json"
PREFIX = "bench_"


def available() -> list[str]:
    return sorted(p.stem[len(PREFIX):] for p in BENCH_DIR.glob(f"{PREFIX}*.py"))


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, payload, sort_keys=True, default=str)


def parse_result_line(line: str) -> dict[str, str]:
    """``RESULT <name> k=v k=v`` -> {k: v} (values as printed)."""
    return dict(item.split("=", 1) for item in line.split()[2:] if "=" in item)


def record_figures(path: Path, name: str, result_line: str, *, when: str, machine: dict, loadavg_1m: float) -> dict:
    """Replace ``name``'s entry in the checked-in figures file; the other benchmarks' entries are kept."""
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        figures = {}
    figures[name] = {"date": when, "machine": machine, "loadavg_1m": loadavg_1m,
                     "figures": parse_result_line(result_line)}
    write_json(path, dict(sorted(figures.items())))
    return figures


def this_machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform(terse=True)}


def run_in_this_process(name: str, out: Path) -> int:
    """Child mode: import the module, call main(), hand the dict back through ``out``."""
    sys.path.insert(0, str(BENCH_DIR))
    result = importlib.import_module(PREFIX + name).main()
    if not isinstance(result, dict):
        print(f"{PREFIX}{name}.main() returned {type(result).__name__}, not a dict", file=sys.stderr)
        return 1
    out.write_text(json.dumps(result, default=str))
    return 0


def run_one(name: str) -> bool:
    print(f"== benchmark {name}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)],
            stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1,
        )
        last = ""
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line.strip()
        code = child.wait()
        elapsed = time.monotonic() - started
        if code != 0 or not out.exists():
            print(f"== benchmark {name} FAILED (exit {code}) after {elapsed:.0f} s", flush=True)
            return False
        if not last.startswith(f"RESULT {name} "):
            print(f"== benchmark {name} FAILED: its last line is not `RESULT {name} key=value ...`: {last!r}",
                  flush=True)
            return False
        write_json(RESULTS_DIR / f"{name}.json", json.loads(out.read_text()))
        record_figures(FIGURES, name, last, when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       machine=this_machine(), loadavg_1m=round(os.getloadavg()[0], 2))
    print(f"== benchmark {name} done in {elapsed:.0f} s -> {RESULTS_DIR / (name + '.json')}", flush=True)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Run the benchmarks in benchmarks/bench_<name>.py.")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all: {', '.join(available())})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_in_this_process(args.child, args.out)
    names = args.names or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available())}",
              file=sys.stderr)
        return 2
    failed = [name for name in names if not run_one(name)]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
