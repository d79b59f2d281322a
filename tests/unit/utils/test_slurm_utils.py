"""Tables for the Slurm script builder and parsers.

Command outputs below were captured from a live Slurm 22.05.8 (one node gpu-node-01 with Gres=gpu:h200:8,
partitions cpu and gpu-training, slurmdbd accounting) unless the case id says "synthetic".
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from hybridflow.exceptions import HybridflowError, InvalidJobSpecError, SlurmOutputParseError
from hybridflow.utils.slurm import (
    JOB_COMMENT_MAX_BYTES,
    JOB_NAME_MAX_LENGTH,
    SACCT_FORMAT,
    SINFO_GPU_FORMAT,
    SQUEUE_FORMAT,
    GresSpec,
    SlurmJobSpec,
    deterministic_job_name,
    gpu_count,
    is_final,
    latest_by_job_id,
    normalise_state,
    parse_gres,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_show_job,
    parse_sinfo_gpus,
    parse_squeue,
    render_sbatch_script,
    scontrol_exit_code,
    scontrol_job_state,
    scontrol_restarts,
)

GOLDEN_DIR = Path(__file__).parent / "golden"
SLURM_JOB_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


def _minimal_spec(**overrides: object) -> SlurmJobSpec:
    fields: dict[str, object] = {"job_name": "hf-test", "partition": "cpu", "command": ["true"]}
    fields.update(overrides)
    return SlurmJobSpec(**fields)


def _training_spec() -> SlurmJobSpec:
    return SlurmJobSpec(
        job_name=deterministic_job_name("train_llm", "train", "scheduled__2026-01-01T00:00:00+00:00"),
        partition="gpu-training",
        nodes=2,
        gpus_per_node=2,
        ranks_per_node=2,
        gpu_type="h200",
        cpus_per_task=4,
        mem="16G",
        time_limit=60,
        signal="USR2@90",
        requeue=True,
        output="%x-%j.out",
        env={"HF_CONFIG": "/x/y.json", "PYTHONUNBUFFERED": "1"},
        setup_lines=("source /opt/hybridflow/venv/bin/activate", 'echo "node=$(hostname)"'),
        command=["python", "/opt/hybridflow/jobs/train.py", "--config", "/x/y.json"],
    )


def _directives(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


def _command_text(script: str) -> str:
    """Everything after the final "exec " (a quoted argv element may span lines)."""
    return script[script.rindex("\nexec ") + len("\nexec ") :]


# --- render_sbatch_script -----------------------------------------------------------------------------------


def test_training_script_matches_golden_file():
    golden = GOLDEN_DIR / "train_sbatch.sh"
    rendered = render_sbatch_script(_training_spec())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
    assert rendered == golden.read_text()


def test_every_option_is_rendered_in_the_fixed_order():
    spec = _minimal_spec(
        partition="gpu-training",
        account="ml",
        qos="normal",
        nodes=2,
        cpus_per_task=8,
        mem="64G",
        gpus_per_node=4,
        gpu_type="h200",
        constraint="h200&ib",
        time_limit="1-00:00:00",
        signal="USR2@120",
        requeue=True,
        workdir="/scratch/run dir",
        output="/logs/%x-%j.out",
        error="/logs/%x-%j.err",
    )
    assert _directives(render_sbatch_script(spec)) == [
        "#SBATCH --job-name=hf-test",
        "#SBATCH --partition=gpu-training",
        "#SBATCH --account=ml",
        "#SBATCH --qos=normal",
        "#SBATCH --nodes=2",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=64G",
        "#SBATCH --gres=gpu:h200:4",
        "#SBATCH --constraint='h200&ib'",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --signal=B:USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --chdir='/scratch/run dir'",
        "#SBATCH --output=/logs/%x-%j.out",
        "#SBATCH --error=/logs/%x-%j.err",
    ]


def test_minimal_spec_renders_only_what_is_set():
    assert render_sbatch_script(_minimal_spec()) == (
        "#!/bin/bash\n"
        "#SBATCH --job-name=hf-test\n"
        "#SBATCH --partition=cpu\n"
        "#SBATCH --nodes=1\n"
        "#SBATCH --cpus-per-task=1\n"
        "#SBATCH --no-requeue\n"
        "set -euo pipefail\n"
        "umask 0002\n"
        "exec true\n"
    )


def test_ranks_start_as_one_srun_step_with_one_gpu_each_and_every_rank_signalled():
    script = render_sbatch_script(_minimal_spec(nodes=2, gpus_per_node=4, ranks_per_node=4, cpus_per_task=2,
                                                signal="USR2@90", command=["python", "train.py", "--config", "a b"]))
    assert "#SBATCH --ntasks-per-node=4" in _directives(script)
    # No "B:": Slurm signals the srun step's tasks (every rank), not the batch shell.
    assert "#SBATCH --signal=USR2@90" in _directives(script)
    assert script.splitlines()[-1] == (
        "exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=4 --ntasks=8 --cpus-per-task=2 "
        "--gpus-per-task=1 --gpu-bind=single:1 -- python train.py --config 'a b'")


def test_ranks_without_gpus_start_an_srun_step_without_gpu_binding():
    line = render_sbatch_script(_minimal_spec(nodes=2, ranks_per_node=1)).splitlines()[-1]
    assert line == "exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 --ntasks=2 --cpus-per-task=1 -- true"


@pytest.mark.parametrize(
    ("overrides", "expected_line"),
    [
        ({"gpus_per_node": 2}, "#SBATCH --gres=gpu:2"),
        ({"gpus_per_node": 8, "gpu_type": "h200"}, "#SBATCH --gres=gpu:h200:8"),
        ({"time_limit": 1}, "#SBATCH --time=1"),
        ({"time_limit": "02:30:00"}, "#SBATCH --time=02:30:00"),
        ({"time_limit": "36:00:00"}, "#SBATCH --time=36:00:00"),
        ({"mem": "512"}, "#SBATCH --mem=512"),
        ({"signal": "SIGTERM@30"}, "#SBATCH --signal=B:SIGTERM@30"),
        ({"requeue": False}, "#SBATCH --no-requeue"),
        ({"requeue": True}, "#SBATCH --open-mode=append"),
        ({"output": "/logs/it's %j.out"}, "#SBATCH --output='/logs/it'\"'\"'s %j.out'"),
        ({"comment": '{"dag_id":"d","v":1}'}, """#SBATCH --comment='{"dag_id":"d","v":1}'"""),
    ],
)
def test_option_rendering(overrides, expected_line):
    assert expected_line in _directives(render_sbatch_script(_minimal_spec(**overrides)))


def test_no_gres_line_without_gpus():
    assert not [line for line in _directives(render_sbatch_script(_minimal_spec())) if "--gres" in line]


@pytest.mark.parametrize(
    "directive_value",
    ["/scratch/dir with space", "/logs/it's-%j.out", '/logs/say "hi"-%j.out', "/logs/a;b|c&d#e-%j"],
)
def test_directive_values_read_back_intact(directive_value):
    # sbatch reads #SBATCH values with shell-like quote rules (single and double quotes), so shlex.split
    # stands in for it here; the quoted forms were accepted by a live sbatch 22.05.8.
    (line,) = [
        line
        for line in _directives(render_sbatch_script(_minimal_spec(workdir=directive_value)))
        if line.startswith("#SBATCH --chdir=")
    ]
    assert shlex.split(line.removeprefix("#SBATCH --chdir=")) == [directive_value]


@pytest.mark.parametrize(
    "comment",
    ['{"dag_id":"nightly_training","run_id":"manual__2026-01-01T00:00:00+00:00","task_id":"t","v":1}',
     '{"task_id":"tâche d\'été"}', "x" * JOB_COMMENT_MAX_BYTES],
    ids=["job-key", "quotes-and-utf8", "longest"],
)
def test_comment_directive_reads_back_intact(comment):
    # Measured on a live sbatch 22.05.8: squeue -o %k printed each of these exactly as given; 1025 bytes refused.
    (line,) = [line for line in _directives(render_sbatch_script(_minimal_spec(comment=comment)))
               if line.startswith("#SBATCH --comment=")]
    assert shlex.split(line.removeprefix("#SBATCH --comment=")) == [comment]
    assert _directives(render_sbatch_script(_minimal_spec(comment=comment)))[-1] == line


HOSTILE_ARGV_ELEMENTS = [
    "$(touch {marker})",
    "`touch {marker}`",
    "; touch {marker}",
    "a && touch {marker}",
    "x\ntouch {marker}\n",
    "it's '$(touch {marker})'",
    '"$(touch {marker})"',
    "${{HOME}}$HOME",
    "back\\slash",
    "#SBATCH --partition=evil",
    "",
    "  spaced  ",
    "*",
]


@pytest.mark.parametrize("hostile", HOSTILE_ARGV_ELEMENTS)
def test_command_elements_round_trip_through_shell_quoting(hostile):
    argv = ["python", "/opt/hybridflow/jobs/train.py", "--name", hostile.format(marker="/tmp/pwned")]
    script = render_sbatch_script(_minimal_spec(command=argv))
    assert shlex.split(_command_text(script)) == argv


def test_hostile_command_and_env_are_inert_when_bash_runs_the_script(tmp_path):
    marker = tmp_path / "pwned"
    argv = ["printf", "%s\\0", *(element.format(marker=marker) for element in HOSTILE_ARGV_ELEMENTS)]
    env = {"HF_VALUE": f"$(touch {marker}) `touch {marker}` it's\nsecond line"}
    spec = _minimal_spec(command=argv, env=env, setup_lines=('printf "%s\\0" "$HF_VALUE"',))
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch_script(spec))

    completed = subprocess.run(["bash", str(script)], capture_output=True, check=True, cwd=tmp_path)

    assert completed.stdout.decode().split("\0")[:-1] == [env["HF_VALUE"], *argv[2:]]
    assert not marker.exists()


def test_env_values_are_quoted_and_names_kept_in_order():
    script = render_sbatch_script(_minimal_spec(env={"B_VAR": "two words", "A_VAR": "$(x)"}))
    assert "export B_VAR='two words'\nexport A_VAR='$(x)'\n" in script


def test_setup_lines_follow_exports_and_precede_the_command_verbatim():
    script = render_sbatch_script(
        _minimal_spec(env={"X": "1"}, setup_lines=("module load cuda/12.4", "source $VENV/bin/activate"))
    )
    body = script.splitlines()[script.splitlines().index("set -euo pipefail") :]
    assert body == [
        "set -euo pipefail",
        "umask 0002",
        "export X=1",
        "module load cuda/12.4",
        "source $VENV/bin/activate",
        "exec true",
    ]


def test_spec_is_frozen_and_copies_its_inputs():
    argv = ["python", "a.py"]
    env = {"A": "1"}
    spec = _minimal_spec(command=argv, env=env)
    argv.append("--late")
    env["B"] = "2"
    assert spec.command == ("python", "a.py")
    assert spec.env == {"A": "1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.partition = "other"  # type: ignore[misc]


# --- SlurmJobSpec validation --------------------------------------------------------------------------------

INVALID_SPECS = [
    ("job_name", {"job_name": ""}),
    ("job_name", {"job_name": "has space"}),
    ("job_name", {"job_name": "a:b"}),
    ("job_name", {"job_name": "x\n#SBATCH --partition=evil"}),
    ("job_name", {"job_name": "a" * (JOB_NAME_MAX_LENGTH + 1)}),
    ("partition", {"partition": "gpu training"}),
    ("partition", {"partition": "cpu,gpu-training"}),
    ("partition", {"partition": None}),
    ("account", {"account": "ml team"}),
    ("qos", {"qos": "normal\n"}),
    ("nodes", {"nodes": 0}),
    ("nodes", {"nodes": True}),
    ("nodes", {"nodes": "1"}),
    ("gpus_per_node", {"gpus_per_node": -1}),
    ("gpus_per_node", {"gpus_per_node": 1.0}),
    ("ranks_per_node", {"ranks_per_node": -1}),
    ("ranks_per_node", {"ranks_per_node": 2.0}),
    ("ranks_per_node", {"ranks_per_node": "2"}),
    ("ranks_per_node", {"gpus_per_node": 4, "ranks_per_node": 2}),
    ("gpu_type", {"gpu_type": "h200"}),
    ("gpu_type", {"gpus_per_node": 1, "gpu_type": "h200:8"}),
    ("cpus_per_task", {"cpus_per_task": 0}),
    ("mem", {"mem": "16GB"}),
    ("mem", {"mem": "16 G"}),
    ("mem", {"mem": "0"}),
    ("mem", {"mem": "-1G"}),
    ("mem", {"mem": 16}),
    ("time_limit", {"time_limit": 0}),
    ("time_limit", {"time_limit": -5}),
    ("time_limit", {"time_limit": True}),
    ("time_limit", {"time_limit": 1.5}),
    ("time_limit", {"time_limit": "60"}),
    ("time_limit", {"time_limit": "1:00"}),
    ("time_limit", {"time_limit": "00:60:00"}),
    ("time_limit", {"time_limit": "1-24:00:00"}),
    ("time_limit", {"time_limit": "00:00:00"}),
    ("constraint", {"constraint": "h200 && ib"}),
    ("constraint", {"constraint": "h200\nib"}),
    ("signal", {"signal": "USR2"}),
    ("signal", {"signal": "USR2@"}),
    ("signal", {"signal": "B:USR2@90"}),
    ("signal", {"signal": "NOSUCHSIG@90"}),
    ("signal", {"signal": "usr2@90"}),
    ("signal", {"signal": "USR2@70000"}),
    ("requeue", {"requeue": "yes"}),
    ("output", {"output": "/logs/a\nb"}),
    ("output", {"output": ""}),
    ("output", {"output": "C:\\logs\\%j.out"}),
    ("error", {"error": "/logs/\r%j"}),
    ("workdir", {"workdir": "/scratch/\x00"}),
    ("comment", {"comment": '{"a":"b\\"c"}'}),
    ("comment", {"comment": "two\nlines"}),
    ("comment", {"comment": ""}),
    ("comment", {"comment": "é" * (JOB_COMMENT_MAX_BYTES // 2 + 1)}),
    ("command", {"command": "python train.py"}),
    ("command", {"command": []}),
    ("command", {"command": ["python", 3]}),
    ("command", {"command": ["python", "a\x00b"]}),
    ("setup_lines", {"setup_lines": "source venv/bin/activate"}),
    ("setup_lines", {"setup_lines": ("echo a\necho b",)}),
    ("env", {"env": {"1ST": "x"}}),
    ("env", {"env": {"A-B": "x"}}),
    ("env", {"env": {"A": 1}}),
    ("env", {"env": [("A", "1")]}),
]


@pytest.mark.parametrize(
    ("field_name", "overrides"), INVALID_SPECS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_SPECS)]
)
def test_invalid_field_is_named_in_the_error(field_name, overrides):
    with pytest.raises(InvalidJobSpecError, match=rf"^SlurmJobSpec\.{field_name}=") as raised:
        _minimal_spec(**overrides)
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, HybridflowError)


# --- deterministic_job_name ---------------------------------------------------------------------------------


def test_job_name_is_pinned_for_a_known_triple():
    # Pinned: a changed name would orphan jobs submitted before an upgrade.
    assert deterministic_job_name("train_llm", "train", "scheduled__2026-01-01T00:00:00+00:00") == (
        "hf-train_llm-train-scheduled__2026-01-01T00_00_00_00_00-c146b8fdcca68801"
    )


@pytest.mark.parametrize(
    ("dag_id", "task_id", "run_id"),
    [
        ("etl", "spark.features", "manual__2026-12-02T11:48:25.123456+00:00"),
        ("dag with spaces", "task/slash", "run;$(id)"),
        ("d" * 300, "t" * 300, "r" * 300),
        ("ünïcode", "タスク", "asset_triggered__2026"),
    ],
)
def test_job_name_is_valid_for_arbitrary_ids(dag_id, task_id, run_id):
    name = deterministic_job_name(dag_id, task_id, run_id)
    assert SLURM_JOB_NAME_RE.fullmatch(name)
    assert _minimal_spec(job_name=name).job_name == name


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("dag", "task", "run:1"), ("dag", "task", "run+1")),
        (("dag", "task", "run_1"), ("dag", "task", "run:1")),
        (("a-b", "c", "r"), ("a", "b-c", "r")),
        (("d" * 300, "t", "run1"), ("d" * 300, "t", "run2")),
    ],
)
def test_job_names_differ_when_ids_differ(first, second):
    assert deterministic_job_name(*first) != deterministic_job_name(*second)


def test_job_name_uses_the_prefix_and_rejects_a_bad_one():
    assert deterministic_job_name("d", "t", "r", prefix="hybrid").startswith("hybrid-d-t-r-")
    with pytest.raises(InvalidJobSpecError, match="prefix"):
        deterministic_job_name("d", "t", "r", prefix="bad prefix")


# --- sbatch --parsable --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdout", "job_id"),
    [("12\n", "12"), ("123", "123"), ("4567;cluster-a\n", "4567"), ("  89 \n\n", "89")],
)
def test_parse_sbatch_parsable(stdout, job_id):
    assert parse_sbatch_parsable(stdout) == job_id


@pytest.mark.parametrize(
    "stdout", ["", "\n", "abc", "Submitted batch job 123", "12a", "-1", "123;", "1\n2\n"]
)
def test_parse_sbatch_parsable_rejects(stdout):
    with pytest.raises(SlurmOutputParseError, match=re.escape(repr(stdout))):
        parse_sbatch_parsable(stdout)


# --- job states ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "requeue_enabled", "final"),
    [
        ("PENDING", False, False),
        ("RUNNING", False, False),
        ("REQUEUED", False, False),
        ("COMPLETING", True, False),
        ("SUSPENDED", False, False),
        ("COMPLETED", False, True),
        ("FAILED", True, True),
        ("TIMEOUT", True, True),
        ("OUT_OF_MEMORY", False, True),
        ("CANCELLED by 1001", True, True),
        ("PREEMPTED", False, True),
        ("PREEMPTED", True, False),
        ("NODE_FAIL", False, True),
        ("NODE_FAIL", True, False),
        ("SOME_FUTURE_STATE", False, True),
    ],
)
def test_is_final(state, requeue_enabled, final):
    assert is_final(state, requeue_enabled) is final


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("CANCELLED by 0", ("CANCELLED", 0)),
        ("CANCELLED", ("CANCELLED", None)),
        ("NODE_FAIL\n", ("NODE_FAIL", None)),
    ],
)
def test_normalise_state(text, expected):
    assert normalise_state(text) == expected


@pytest.mark.parametrize("text", ["", "running", "CANCELLED by", "CANCELLED by root", "1"])
def test_unknown_state_text_is_rejected(text):
    with pytest.raises(SlurmOutputParseError, match=re.escape(repr(text))):
        normalise_state(text)
    with pytest.raises(SlurmOutputParseError, match=re.escape(repr(text))):
        is_final(text, requeue_enabled=False)


# --- sacct --------------------------------------------------------------------------------------------------

SACCT_OUTPUT = """\
1|sleep|CANCELLED by 0|0:0|00:00:49|billing=2,cpu=2,gres/gpu=2,node=1|2026-12-02T11:46:05|2026-12-02T11:46:54
3|hf-probe_sleep.1|FAILED|1:0|00:00:00||2026-12-02T11:46:01|2026-12-02T11:46:01
4|hf-probe_sleep.1|CANCELLED by 0|0:0|00:00:00||None|2026-12-02T11:46:31
6|q name|FAILED|3:0|00:00:00|billing=1,cpu=1,node=1|2026-12-02T11:46:38|2026-12-02T11:46:38
8|bs|TIMEOUT|0:0|00:01:01|billing=1,cpu=1,node=1|2026-12-02T11:47:38|2026-12-02T11:48:39
11|sig-sigsteps|RUNNING|0:0|00:01:26|billing=1,cpu=1,node=1|2026-12-02T11:48:26|Unknown
12|hf-train|COMPLETED|0:0|1-02:03:04|billing=4,cpu=4,gres/gpu=1,mem=16G,node=1|2026-12-01T09:00:00|2026-12-02T11:03:04
"""


def test_sacct_format_lists_exactly_the_parsed_fields():
    assert SACCT_FORMAT == "JobID,JobName,State,ExitCode,Elapsed,AllocTRES,Start,End"
    assert [f.name for f in dataclasses.fields(parse_sacct(SACCT_OUTPUT)[0])] == [
        "job_id",
        "job_name",
        "state",
        "cancelled_by",
        "exit_code",
        "exit_signal",
        "elapsed_seconds",
        "alloc_tres",
        "gpus",
        "start",
        "end",
    ]


def test_parse_sacct_reads_every_line():
    records = parse_sacct(SACCT_OUTPUT)
    assert [(r.job_id, r.state, r.cancelled_by, r.exit_code, r.exit_signal, r.gpus) for r in records] == [
        ("1", "CANCELLED", 0, 0, 0, 2),
        ("3", "FAILED", None, 1, 0, 0),
        ("4", "CANCELLED", 0, 0, 0, 0),
        ("6", "FAILED", None, 3, 0, 0),
        ("8", "TIMEOUT", None, 0, 0, 0),
        ("11", "RUNNING", None, 0, 0, 0),
        ("12", "COMPLETED", None, 0, 0, 1),
    ]
    first, never_started, cancelled_pending, with_space, timeout, running, long_job = records
    assert first.job_name == "sleep"
    assert first.elapsed_seconds == 49
    assert first.alloc_tres == {"billing": "2", "cpu": "2", "gres/gpu": "2", "node": "1"}
    assert first.start == datetime(2026, 12, 2, 11, 46, 5)
    assert first.end == datetime(2026, 12, 2, 11, 46, 54)
    assert never_started.alloc_tres == {}
    assert cancelled_pending.start is None
    assert with_space.job_name == "q name"
    assert timeout.elapsed_seconds == 61
    assert running.end is None
    assert long_job.elapsed_seconds == 26 * 3600 + 3 * 60 + 4
    assert long_job.alloc_tres["mem"] == "16G"


@pytest.mark.parametrize(
    ("line", "attribute", "expected"),
    [
        ("5|n|COMPLETED|0:0|03:04.123|cpu=1|None|None", "elapsed_seconds", pytest.approx(184.123)),
        ("5|n|COMPLETED|0:0|2:03:04|cpu=1|None|None", "elapsed_seconds", 7384),
        ("5|n|FAILED|0:9|00:00:01|cpu=1|None|None", "exit_signal", 9),
        ("5|n|COMPLETED|0:0|00:00:01|cpu=1,gres/gpu:h200=2|None|None", "gpus", 2),
        ("5|n|COMPLETED|0:0|00:00:01|cpu=1,gres/gpu=3,gres/gpu:h200=3|None|None", "gpus", 3),
        ("5|a|b|COMPLETED|0:0|00:00:01|cpu=1|None|None", "job_name", "a|b"),
        ("5_3|n|COMPLETED|0:0|00:00:01|cpu=1|None|None", "job_id", "5_3"),
    ],
    ids=[
        "fractional-elapsed",
        "hours",
        "signal",
        "typed-gpu-only",
        "typed-and-total",
        "pipe-in-name",
        "array",
    ],
)
def test_parse_sacct_fields_synthetic(line, attribute, expected):
    (record,) = parse_sacct(line + "\n")
    assert getattr(record, attribute) == expected


@pytest.mark.parametrize(
    "line",
    [
        "5|n|COMPLETED|0:0|00:00:01|cpu=1|None",
        "5.batch|batch|COMPLETED|0:0|00:00:01|cpu=1,mem=0,node=1|None|None",
        "5|n|completed|0:0|00:00:01|cpu=1|None|None",
        "5|n|COMPLETED|0|00:00:01|cpu=1|None|None",
        "5|n|COMPLETED|0:0|soon|cpu=1|None|None",
        "5|n|COMPLETED|0:0|00:00:01|cpu|None|None",
        "5|n|COMPLETED|0:0|00:00:01|gres/gpu=two|None|None",
        "5|n|COMPLETED|0:0|00:00:01|cpu=1|12/02-11:46:05|None",
    ],
    ids=["short", "step", "state", "exit-code", "elapsed", "tres", "gpu-count", "time-format"],
)
def test_parse_sacct_rejects(line):
    with pytest.raises(SlurmOutputParseError):
        parse_sacct(line + "\n")


def test_parse_sacct_of_no_jobs_is_empty():
    assert parse_sacct("") == []


def test_latest_run_of_a_requeued_job_wins():
    # sacct -X -P -n -D: job 2 was requeued by hand, then both jobs were hit by a node failure and
    # requeued again; job 8 then ran into its time limit.
    duplicates = """\
2|hf-probe_sleep.1|REQUEUED|0:0|00:00:49|billing=1,cpu=1,gres/gpu=1,node=1|2026-12-02T11:46:05|2026-12-02T11:46:54
8|bs|NODE_FAIL|0:0|00:00:34|billing=1,cpu=1,node=1|2026-12-02T11:46:53|2026-12-02T11:47:27
2|hf-probe_sleep.1|NODE_FAIL|0:0|00:00:19|billing=1,cpu=1,gres/gpu=1,node=1|2026-12-02T11:47:08|2026-12-02T11:47:27
2|hf-probe_sleep.1|PENDING|0:0|00:00:00|billing=1,cpu=1,gres/gpu=1,node=1|Unknown|Unknown
8|bs|TIMEOUT|0:0|00:01:01|billing=1,cpu=1,node=1|2026-12-02T11:47:38|2026-12-02T11:48:39
"""
    latest = latest_by_job_id(parse_sacct(duplicates))
    assert {job_id: record.state for job_id, record in latest.items()} == {"2": "PENDING", "8": "TIMEOUT"}


# --- squeue -------------------------------------------------------------------------------------------------

SQUEUE_OUTPUT = """\
4|hf-probe_sleep.1|PENDING|Resources|gres:gpu:h200:8|1|0:00
5|hf-probe_sleep.1|PENDING|BeginTime|gres:gpu:h200:1|1|0:00
1|hf-probe_sleep.1|RUNNING|None|gres:gpu:h200:2|1|0:08
2|hf-probe_sleep.1|RUNNING|None|gres:gpu:1|1|0:08
8|bs|RUNNING|None|N/A|1|1:02:26
"""


def test_squeue_format():
    assert SQUEUE_FORMAT == "%i|%j|%T|%r|%b|%D|%M"


def test_parse_squeue():
    records = parse_squeue(SQUEUE_OUTPUT)
    assert [(r.job_id, r.state, r.reason, r.gpus_per_node, r.nodes, r.elapsed_seconds) for r in records] == [
        ("4", "PENDING", "Resources", 8, 1, 0),
        ("5", "PENDING", "BeginTime", 1, 1, 0),
        ("1", "RUNNING", "None", 2, 1, 8),
        ("2", "RUNNING", "None", 1, 1, 8),
        ("8", "RUNNING", "None", 0, 1, 3746),
    ]
    assert records[0].name == "hf-probe_sleep.1"
    assert records[0].gres == "gres:gpu:h200:8"


@pytest.mark.parametrize(
    ("line", "attribute", "expected"),
    [
        ("7|a|b|RUNNING|None|gres:gpu:2|1|0:01", "name", "a|b"),
        ("7|n|RUNNING|None|gres/gpu:h200:2|2|1-00:00:01", "gpus_per_node", 2),
        ("7|n|RUNNING|None|gres/gpu:h200:2|2|1-00:00:01", "elapsed_seconds", 86401),
        ("7|n|PENDING|Priority|gres:gpu:h200:2,gres:shard:1|4|0:00", "gpus_per_node", 2),
    ],
    ids=["pipe-in-name", "slash-prefix", "days", "two-gres"],
)
def test_parse_squeue_fields_synthetic(line, attribute, expected):
    (record,) = parse_squeue(line)
    assert getattr(record, attribute) == expected


@pytest.mark.parametrize(
    "line",
    [
        "7|n|RUNNING|None|N/A|1",
        "7|n|RUNNING|None|N/A|one|0:01",
        "7|n|Running|None|N/A|1|0:01",
        "7|n|RUNNING|None|gpu:x:y:z|1|0:01",
    ],
    ids=["short", "nodes", "state", "gres"],
)
def test_parse_squeue_rejects(line):
    with pytest.raises(SlurmOutputParseError):
        parse_squeue(line)


# --- scontrol show job --------------------------------------------------------------------------------------

SCONTROL_FAILED_WITH_SPACES = """\
JobId=6 JobName=q name
   UserId=mlops(1001) GroupId=mlops(1001) MCS_label=N/A
   Priority=4294901754 Nice=0 Account=root QOS=normal
   JobState=FAILED Reason=NonZeroExitCode Dependency=(null)
   Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0
   RunTime=00:00:00 TimeLimit=00:02:00 TimeMin=N/A
   SubmitTime=2026-12-02T11:46:21 EligibleTime=2026-12-02T11:46:21
   AccrueTime=2026-12-02T11:46:21
   StartTime=2026-12-02T11:46:38 EndTime=2026-12-02T11:46:38 Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-02T11:46:38 Scheduler=Backfill
   Partition=cpu AllocNode:Sid=localhost:3522
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=gpu-node-01
   BatchHost=gpu-node-01
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=1,node=1,billing=1
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=100M MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=/home/mlops/jobs/quoted.sh
   WorkDir=/home/mlops/jobs/dir with  space
   Comment=it's # not a comment=really 
   StdErr=/home/mlops/jobs/dir with  space/q name-6.out
   StdIn=/dev/null
   StdOut=/home/mlops/jobs/dir with  space/q name-6.out
   Power=
   

"""

SCONTROL_REQUEUED_RUNNING = """\
JobId=2 JobName=hf-probe_sleep.1
   UserId=mlops(1001) GroupId=mlops(1001) MCS_label=N/A
   Priority=4294901758 Nice=0 Account=root QOS=normal
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:11 TimeLimit=00:05:00 TimeMin=N/A
   Partition=gpu-training AllocNode:Sid=localhost:3522
   TRES=cpu=1,node=1,billing=1,gres/gpu=1
   Command=/home/mlops/jobs/sleep.sh
   WorkDir=/home/mlops/jobs
   Power=
   TresPerNode=gres:gpu:1
   

"""

SCONTROL_TIMEOUT_ONE_LINE = (
    "JobId=8 JobName=bs UserId=mlops(1001) GroupId=mlops(1001) MCS_label=N/A Priority=4294901752 Nice=0 "
    "Account=root QOS=normal JobState=TIMEOUT Reason=TimeLimit Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:01:01 TimeLimit=00:01:00 TimeMin=N/A "
    "Command=(null) WorkDir=/home/mlops/jobs/dir with space StdIn=/dev/null Power= "
    "TresPerNode=gres:gpu:h200:1 \n"
)


def test_parse_scontrol_keeps_values_with_spaces():
    fields = parse_scontrol_show_job(SCONTROL_FAILED_WITH_SPACES)
    assert fields["JobId"] == "6"
    assert fields["JobName"] == "q name"
    assert fields["WorkDir"] == "/home/mlops/jobs/dir with  space"
    assert fields["StdOut"] == "/home/mlops/jobs/dir with  space/q name-6.out"
    assert fields["Comment"] == "it's # not a comment=really"
    assert fields["TRES"] == "cpu=1,node=1,billing=1"
    assert fields["AllocNode:Sid"] == "localhost:3522"
    assert fields["ReqB:S:C:T"] == "0:0:*:*"
    assert fields["Power"] == ""
    assert (scontrol_job_state(fields), scontrol_restarts(fields), scontrol_exit_code(fields)) == (
        "FAILED",
        0,
        (3, 0),
    )


def test_parse_scontrol_requeued_job():
    fields = parse_scontrol_show_job(SCONTROL_REQUEUED_RUNNING)
    assert (scontrol_job_state(fields), scontrol_restarts(fields), scontrol_exit_code(fields)) == (
        "RUNNING",
        1,
        (0, 0),
    )
    assert fields["Reason"] == "None"
    assert fields["TresPerNode"] == "gres:gpu:1"


def test_parse_scontrol_one_line_form():
    fields = parse_scontrol_show_job(SCONTROL_TIMEOUT_ONE_LINE)
    assert (scontrol_job_state(fields), scontrol_restarts(fields), scontrol_exit_code(fields)) == (
        "TIMEOUT",
        1,
        (0, 15),
    )
    assert fields["WorkDir"] == "/home/mlops/jobs/dir with space"
    assert fields["Power"] == ""


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        "slurm_load_jobs error: Invalid job id specified\n",
        SCONTROL_REQUEUED_RUNNING + SCONTROL_FAILED_WITH_SPACES,
        "UserId=mlops(1001) JobState=RUNNING\n",
    ],
    ids=["empty", "error-text", "two-jobs", "no-job-id"],
)
def test_parse_scontrol_rejects(stdout):
    with pytest.raises(SlurmOutputParseError):
        parse_scontrol_show_job(stdout)


@pytest.mark.parametrize(
    ("helper", "fields"),
    [
        (scontrol_restarts, {"JobId": "1", "JobState": "RUNNING"}),
        (scontrol_restarts, {"JobId": "1", "Restarts": "many"}),
        (scontrol_exit_code, {"JobId": "1", "ExitCode": "15"}),
        (scontrol_job_state, {"JobId": "1"}),
    ],
)
def test_scontrol_helpers_reject(helper, fields):
    with pytest.raises(SlurmOutputParseError):
        helper(fields)


# --- sinfo --------------------------------------------------------------------------------------------------


def test_sinfo_format():
    assert SINFO_GPU_FORMAT == "NodeList:|,StateLong:|,Gres:|,GresUsed:|"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("gpu-node-01|idle|gpu:h200:8|gpu:h200:0(IDX:N/A)|", ("gpu-node-01", "idle", "", True, 8, 0, 8)),
        ("gpu-node-01|mixed|gpu:h200:8|gpu:h200:3(IDX:0-2)|", ("gpu-node-01", "mixed", "", True, 8, 3, 5)),
        (
            "gpu-node-01|draining|gpu:h200:8|gpu:h200:1(IDX:0)|",
            ("gpu-node-01", "draining", "", False, 8, 1, 0),
        ),
        (
            "gpu-node-01|drained|gpu:h200:8|gpu:h200:0(IDX:N/A)|",
            ("gpu-node-01", "drained", "", False, 8, 0, 0),
        ),
        # synthetic from here on: flags and layouts from sinfo(1), not produced on the one-node cluster
        (
            "gpu-node-02|allocated|gpu:h200:8(S:0-1)|gpu:h200:8(IDX:0-7)|",
            ("gpu-node-02", "allocated", "", True, 8, 8, 0),
        ),
        ("gpu-node-03|allocated+|gpu:8|gpu:2|", ("gpu-node-03", "allocated", "+", True, 8, 2, 6)),
        ("gpu-node-04|down*|gpu:h200:8|gpu:h200:0(IDX:N/A)|", ("gpu-node-04", "down", "*", False, 8, 0, 0)),
        ("gpu-node-05|idle~|gpu:h200:8|gpu:h200:0(IDX:N/A)|", ("gpu-node-05", "idle", "~", False, 8, 0, 0)),
        ("gpu-node-06|idle#|gpu:h200:8|gpu:h200:0(IDX:N/A)|", ("gpu-node-06", "idle", "#", False, 8, 0, 0)),
        ("gpu-node-07|idle*|gpu:h200:8|gpu:h200:0(IDX:N/A)|", ("gpu-node-07", "idle", "*", False, 8, 0, 0)),
        (
            "gpu-node-08|mixed-|gpu:h200:4(S:0),gpu:a100:4(S:1)|gpu:h200:1(IDX:0),gpu:a100:2(IDX:4,6)|",
            ("gpu-node-08", "mixed", "-", True, 8, 3, 5),
        ),
        ("cpu-node-01|IDLE|(null)|gpu:0|", ("cpu-node-01", "idle", "", True, 0, 0, 0)),
    ],
)
def test_parse_sinfo_gpus(line, expected):
    (node,) = parse_sinfo_gpus(line + "\n")
    assert (
        node.name,
        node.state,
        "".join(sorted(node.flags)),
        node.available,
        node.gpus_total,
        node.gpus_used,
        node.gpus_free,
    ) == expected


def test_parse_sinfo_gpus_keeps_node_order():
    stdout = "gpu-node-01|idle|gpu:h200:8|gpu:h200:0(IDX:N/A)|\ngpu-node-02|mixed|gpu:8|gpu:1|\n"
    assert [node.name for node in parse_sinfo_gpus(stdout)] == ["gpu-node-01", "gpu-node-02"]


@pytest.mark.parametrize(
    "line",
    [
        # -O without ":|" pads to 20 characters and has no separator.
        "gpu-node-01         idle                ",
        "gpu-node-01|idle|gpu:h200:8|",
        "gpu-node-01|idle|gpu:h200:8|gpu:0|extra|",
        "gpu-node-01|idle?|gpu:h200:8|gpu:0|",
        "|idle|gpu:h200:8|gpu:0|",
        "gpu-node-01|idle|gpu:h200:eight|gpu:0|",
    ],
    ids=["padded", "short", "long", "state-flag", "no-name", "gres"],
)
def test_parse_sinfo_gpus_rejects(line):
    with pytest.raises(SlurmOutputParseError):
        parse_sinfo_gpus(line + "\n")


# --- GRES ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu:h200:8", (GresSpec("gpu", "h200", 8),)),
        ("gpu:8", (GresSpec("gpu", None, 8),)),
        ("gpu", (GresSpec("gpu", None, 1),)),
        ("gpu:h200:8(S:0-1)", (GresSpec("gpu", "h200", 8),)),
        ("gpu:h200:2(IDX:0-1)", (GresSpec("gpu", "h200", 2, (0, 1)),)),
        ("gpu:h200:3(IDX:0,2-3)", (GresSpec("gpu", "h200", 3, (0, 2, 3)),)),
        ("gpu:h200:0(IDX:N/A)", (GresSpec("gpu", "h200", 0),)),
        ("gpu:a100_80g:4(S:0),gpu:h200:4(S:1)", (GresSpec("gpu", "a100_80g", 4), GresSpec("gpu", "h200", 4))),
        (
            "gpu:h200:8,shard:h200:32,bw:lustre:4G",
            (
                GresSpec("gpu", "h200", 8),
                GresSpec("shard", "h200", 32),
                GresSpec("bw", "lustre", 4 * 1024**3),
            ),
        ),
        ("(null)", ()),
        ("N/A", ()),
        ("", ()),
    ],
)
def test_parse_gres(text, expected):
    assert parse_gres(text) == expected


@pytest.mark.parametrize(
    "text", ["gpu:h200:x", "gpu:h200:8:9", "gpu:h200:2(IDX:a-b)", "gpu:h200:2(IDX:0-1", ":8", "gpu::8"]
)
def test_parse_gres_rejects(text):
    with pytest.raises(SlurmOutputParseError, match=re.escape(repr(text))):
        parse_gres(text)


def test_gpu_count_ignores_other_gres():
    assert gpu_count(parse_gres("gpu:h200:2,shard:h200:16,gpu:a100:1")) == 3


# --- node self-check and excluded nodes ----------------------------------------------------------------------


def test_node_check_runs_once_per_node_with_its_gpus_before_the_ranks_and_excluded_nodes_are_directives():
    hostile = "/runs/a b'; touch /tmp/pwned #"
    spec = _minimal_spec(nodes=2, gpus_per_node=2, ranks_per_node=2, command=["python", "train.py"],
                         node_check=["python", "node_check.py", "--checkpoint-dir", hostile],
                         exclude=["gpu-node-01", "gpu-node-03"])
    lines = render_sbatch_script(spec).splitlines()
    check = next(line for line in lines if "node_check.py" in line)
    assert lines.index(check) == len(lines) - 2 and lines[-1].startswith("exec srun")  # right before the ranks
    assert shlex.split(check) == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gres=gpu:2", "--",
                                  "python", "node_check.py", "--checkpoint-dir", hostile]
    assert "#SBATCH --exclude=gpu-node-01,gpu-node-03" in _directives(render_sbatch_script(spec))
    assert "node_check" not in render_sbatch_script(_minimal_spec()) and "--exclude" not in render_sbatch_script(
        _minimal_spec())


@pytest.mark.parametrize("field_name, value", [
    ("exclude", "gpu-node-01"), ("exclude", ["gpu node"]), ("exclude", ["a\nb"]), ("exclude", [""]),
    ("node_check", "python check.py"), ("node_check", ["python", "a\x00b"]), ("node_check", [3]),
])
def test_bad_node_check_or_exclude_is_refused_naming_the_field(field_name, value):
    with pytest.raises(InvalidJobSpecError, match=field_name):
        _minimal_spec(**{field_name: value})


@pytest.mark.parametrize(("value", "expected"), [(2, 2), ("2", 2), (" 8 ", 8), ("0", 0), (0, 0)])
def test_whole_number_takes_an_int_or_a_rendered_template(value, expected):
    from hybridflow.utils.slurm import whole_number

    assert whole_number(value, "gpus_per_node") == expected


@pytest.mark.parametrize("value", [True, 1.0, "1.5", "-1", "", "2; rm -rf /", "{{ params.gpus_per_node }}", None, [2]])
def test_whole_number_refuses_anything_else_naming_the_field(value):
    from hybridflow.exceptions import InvalidJobSpecError
    from hybridflow.utils.slurm import whole_number

    with pytest.raises(InvalidJobSpecError, match=r"gpus_per_node=.* is invalid: use a whole number"):
        whole_number(value, "gpus_per_node")
