"""Every DAG imports with no connections or secrets available, fast, and follows the suite's policy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted(p for p in (REPO / "dags").glob("*.py") if not p.name.startswith("_"))


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No AIRFLOW_CONN_*, no stack state: DAG files must not need a connection at parse time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW_CONN_", "AIRFLOW__", "HYBRIDFLOW_"))}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__UNIT_TEST_MODE="True")
    return env


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    """The DagBag loaded in a subprocess with a clean environment; returns {dag_id: facts} and import errors."""
    tmp = tmp_path_factory.mktemp("airflow_home")
    code = f"""
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / 'dags')!r})
print(json.dumps({{
    "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
    "dags": {{d.dag_id: {{
        "tags": sorted(d.tags), "fileloc": d.fileloc, "doc_md": bool(d.doc_md),
        "params": {{k: dict(p.schema, description=p.description) for k, p in d.params.items()}},
        "defaults": {{k: p.value for k, p in d.params.items() if p.has_value}},
        "tasks": {{t.task_id: {{"owner": t.owner, "retries": t.retries}} for t in d.tasks}},
    }} for d in bag.dags.values()}},
}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(tmp), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_dag_files_exist():
    assert DAG_FILES, "no DAG files found in dags/"


def test_dag_imports_without_errors_or_connections(dagbag):
    assert dagbag["errors"] == {}


def test_dag_every_file_defines_a_dag(dagbag):
    files_with_dags = {Path(d["fileloc"]).name for d in dagbag["dags"].values()}
    assert {p.name for p in DAG_FILES} <= files_with_dags


NO_RETRY_SUFFIXES = ("_gate", "allreduce_preflight", "plan")


def test_dag_policy_tags_owner_retries_docs(dagbag):
    problems = []
    for dag_id, dag in dagbag["dags"].items():
        if not dag["tags"]:
            problems.append(f"{dag_id}: no tags")
        if not dag["doc_md"]:
            problems.append(f"{dag_id}: no doc_md")
        for task_id, task in dag["tasks"].items():
            if task["owner"] in ("", "airflow"):
                problems.append(f"{dag_id}.{task_id}: owner is {task['owner']!r}; use DEFAULT_ARGS")
            # A gate judges figures already written: retrying it reads the same ones, so it may opt out.
            if task["retries"] < 1 and not task_id.endswith(NO_RETRY_SUFFIXES):
                problems.append(f"{dag_id}.{task_id}: retries={task['retries']}; use DEFAULT_ARGS")
    assert problems == []


def test_dag_params_have_descriptions(dagbag):
    """The trigger form shows each param's description; a param without one is a question for on-call."""
    missing = [f"{dag_id}.{name}" for dag_id, dag in dagbag["dags"].items()
               for name, schema in dag["params"].items() if not schema.get("description")]
    assert missing == []


def test_dag_params_refuse_bad_values_at_trigger_time(dagbag):
    """The api-server checks a trigger against these schemas alone: draft-04 (an int is an int), bounded
    numbers, full-match patterns, closed objects (hybridflow.params.strict_params)."""
    from hybridflow.params import DRAFT4, schema_problems

    problems = [f"{dag_id}.{name}: $schema is {schema.get('$schema')!r}; use strict_params()"
                for dag_id, dag in dagbag["dags"].items() for name, schema in dag["params"].items()
                if schema.get("$schema") != DRAFT4]
    problems += [p for dag_id, dag in dagbag["dags"].items() for name, schema in dag["params"].items()
                 for p in schema_problems(schema, f"{dag_id}.{name}")]
    assert problems == []


def patterns(schema) -> list[str]:
    """Every pattern in a schema, nested ones included."""
    found = [schema["pattern"]] if isinstance(schema, dict) and "pattern" in schema else []
    children = schema.values() if isinstance(schema, dict) else schema if isinstance(schema, list) else ()
    return found + [p for child in children for p in patterns(child)]


def test_dag_param_patterns_mean_the_same_in_javascript(dagbag):
    """The UI checks a pattern with JavaScript's RegExp (unicode mode), the api-server with Python's re.search:
    the same verdicts on each param's default and its whitespace and newline variants."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    cases = []
    for dag_id, dag in dagbag["dags"].items():
        for name, schema in dag["params"].items():
            default = dag["defaults"].get(name)
            base = default if isinstance(default, str) else "x1"
            samples = [base, base + "\n", "\n" + base, " " + base, base + " ", base + "\r", "", "\n", "\t"]
            cases += [(f"{dag_id}.{name}", p, samples) for p in patterns(schema)]
    assert cases, "no param patterns found"
    script = ("const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "console.log(JSON.stringify(cases.map(([, p, ss]) => ss.map(s => new RegExp(p, 'u').test(s)))));")
    out = subprocess.run([node, "-e", script], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=60, check=True)
    differ = [(where, sample) for (where, p, samples), js in zip(cases, json.loads(out.stdout), strict=True)
              for sample, verdict in zip(samples, js, strict=True) if bool(re.search(p, sample)) != verdict]
    assert differ == []
    newline_accepted = [where for where, p, samples in cases if re.search(p, samples[1])]
    assert newline_accepted == []


def test_dag_model_preset_choices_are_the_presets_file(dagbag):
    """The trigger form offers exactly the presets the training job can build (include/config/model_presets.json)."""
    from hybridflow.config import model_preset_names

    assert dagbag["dags"]["nightly_training"]["params"]["model_preset"]["enum"] == list(model_preset_names())


# What the DAG processor must never load to parse a DAG file: the jobs' and the hooks' libraries (seconds of
# import each, paid on every parse). The parse time itself is a benchmark figure, not a timed test.
HEAVY_AT_PARSE = ("torch", "numpy", "pandas", "pyarrow", "pyspark", "deepspeed", "matplotlib", "tritonclient",
                  "grpc", "mlflow", "paramiko", "asyncssh", "boto3", "botocore", "scipy", "sklearn")


@pytest.mark.parametrize("dag_file", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_imports_no_heavy_library_at_parse_time(dag_file, tmp_path):
    """The DAG file alone, after what the processor has loaded already: no job or hook library comes with it
    (they belong inside execute(), a task body or a hook's method)."""
    code = f"""
import json, runpy, sys
import airflow.sdk, airflow.sdk.definitions.dag  # the processor has these loaded already
before = set(sys.modules)
runpy.run_path({str(dag_file)!r})
print(json.dumps(sorted({{name.split(".")[0] for name in set(sys.modules) - before}})))
"""
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert sorted(loaded & set(HEAVY_AT_PARSE)) == [], f"{dag_file.name} loads them at parse time"


def test_dag_every_task_has_the_oncall_failure_notifier(tmp_path):
    """Every task of every DAG alerts on-call when it fails: its ``on_failure_callback`` holds the suite's
    OnCallNotifier, whether the task set it itself or inherited it from the DAG's ``default_args``
    (hybridflow.dag_defaults.DEFAULT_ARGS). A task that replaces the callback list, or a DAG without the
    defaults, fails silently at 3 am otherwise."""
    code = f"""
import json
from airflow.dag_processing.dagbag import DagBag
from hybridflow.notifiers.oncall import OnCallNotifier

def callbacks(value):
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]

def notified(value):
    return any(isinstance(c, OnCallNotifier) for c in callbacks(value))

bag = DagBag(dag_folder={str(REPO / 'dags')!r})
print(json.dumps({{
    "errors": sorted(bag.import_errors),
    "dags": {{d.dag_id: {{
        "default_args": notified((d.default_args or {{}}).get("on_failure_callback")),
        "tasks": {{t.task_id: {{"notified": notified(t.on_failure_callback),
                               "callbacks": [type(c).__name__ for c in callbacks(t.on_failure_callback)]}}
                  for t in d.tasks}},
    }} for d in bag.dags.values()}},
}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["errors"] == []
    assert found["dags"], "no DAGs loaded"
    missing = [f"{dag_id}.{task_id}: on_failure_callback={task['callbacks']} "
               f"(DAG default_args provide it: {dag['default_args']})"
               for dag_id, dag in sorted(found["dags"].items()) for task_id, task in sorted(dag["tasks"].items())
               if not task["notified"]]
    assert all(dag["tasks"] for dag in found["dags"].values()), "a DAG without tasks"
    assert missing == [], ("tasks that fail without alerting on-call; attach "
                           "hybridflow.dag_defaults.DEFAULT_ARGS (or failure_alert()) to them")


def test_dag_nightly_task_ids_read_by_other_tasks_exist(dagbag):
    """Templates, Python tasks and the run report pull XComs by NightlyTask's ids: a renamed task or group must
    fail here, not render an empty pull in a night's run."""
    from hybridflow.operators.report import NIGHTLY_SOURCES
    from hybridflow.pipeline.nightly import NightlyTask

    named = {value for key, value in vars(NightlyTask).items() if key.isupper()}
    tasks = set(dagbag["dags"]["nightly_training"]["tasks"])
    assert len(named) == 10 and named <= tasks, sorted(named - tasks)
    assert set(NIGHTLY_SOURCES.values()) <= named


def test_dag_files_leave_deferral_to_the_one_policy():
    """Airflow's ``[operators] default_deferrable`` decides for every Slurm, Triton and checkpoint wait: a DAG file
    that sets ``deferrable=`` itself would split the policy."""
    assert [path.name for path in DAG_FILES if "deferrable=" in path.read_text()] == []
