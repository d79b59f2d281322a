"""The benchmark runner keeps the README's figures traceable: each run's RESULT line, with date, machine and load,
lands in the checked-in benchmarks/figures.json without dropping the other benchmarks' entries."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("line", "parsed"), [
    ("RESULT triton http_bs1_p50_ms=2.2 rows=3", {"http_bs1_p50_ms": "2.2", "rows": "3"}),
    ("RESULT scoring", {}),
    ("RESULT x note=a=b", {"note": "a=b"}),
])
def test_result_line_parses_to_its_figures(runner, line, parsed):
    assert runner.parse_result_line(line) == parsed


def test_figures_file_keeps_other_benchmarks_and_records_when_and_where(runner, tmp_path):
    path = tmp_path / "figures.json"
    machine = {"cpus": 2, "python": "3.11.7", "system": "Linux"}
    runner.record_figures(path, "triton", "RESULT triton p50=2.2", when="2026-12-03T16:07:00Z", machine=machine,
                          loadavg_1m=2.16)
    runner.record_figures(path, "scoring", "RESULT scoring rows=5", when="2026-12-03T17:00:00Z", machine=machine,
                          loadavg_1m=1.0)
    runner.record_figures(path, "triton", "RESULT triton p50=1.9", when="2026-12-04T09:00:00Z", machine=machine,
                          loadavg_1m=0.5)
    figures = json.loads(path.read_text())
    assert list(figures) == ["scoring", "triton"]
    assert figures["triton"] == {"date": "2026-12-04T09:00:00Z", "machine": machine, "loadavg_1m": 0.5,
                                 "figures": {"p50": "1.9"}}
    assert figures["scoring"]["figures"] == {"rows": "5"}


def test_checked_in_figures_name_only_existing_benchmarks(runner):
    figures = json.loads((REPO / "benchmarks" / "figures.json").read_text())
    assert set(figures) <= set(runner.available())
    for name, entry in figures.items():
        assert entry["date"] and entry["machine"]["cpus"] and entry["figures"], name
