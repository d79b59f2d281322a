"""The job-log tail on-call reads: the job's own errors first, known library noise left out, within budget."""

from __future__ import annotations

import pytest
from hybridflow.utils.job_logs import is_noise, readable_tail

ACCELERATOR = ("[2026-12-05 21:12:18,496] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
               "to CPU. If you have GPU or other accelerator, we were unable to detect it.")
STDOUT = "\n".join(["node check gpu-node-01: ok (gpus: not checked; checkpoint filesystem: 50.5 GiB free)",
                    ACCELERATOR, ACCELERATOR]) + "\n"
STDERR = "\n".join([
    "2026-12-05 21:12:25,122 rank0@gpu-node-01 INFO hybridtrain: ranks: 0@gpu-node-01, 1@gpu-node-02",
    *[f"2026-12-05 21:12:25,5{i:02d} rank0@gpu-node-01 INFO hybridtrain: checkpoint step_{i}" for i in range(30)],
    "2026-12-05 21:12:26,168 rank0@gpu-node-01 INFO hybridtrain: finished at step 60: holdout AUC 0.8515",
]) + "\n"


@pytest.mark.parametrize("line, noise", [
    (ACCELERATOR, True),
    ("[2026-12-05 21:12:18,496] [INFO] [real_accelerator.py:254:get_accelerator] Setting ds_accelerator to cpu", True),
    ("[2026-12-05 21:12:19,001] [INFO] [config.py:1000:print] zero_enabled ................. True", True),
    ("node check gpu-node-02: ok (gpus: 1 GPU(s) visible)", True),
    ("NODE CHECK FAILED on gpu-node-02: scratch: Permission denied", False),
    ("rank1@gpu-node-02 WARNING hybridtrain: replacing step_40", False),
    ("[2026-12-05 21:12:19,001] [WARNING] [engine.py:1] something DeepSpeed warns about this run", False),
])
def test_noise_is_only_what_says_nothing_about_the_job(line, noise):
    assert is_noise(line) is noise


def test_a_completed_training_job_leads_with_its_summary_not_deepspeed():
    tail = readable_tail([("job.err", STDERR), ("job.out", STDOUT)], 40)
    lines = tail.splitlines()
    assert len(lines) <= 40 and "real_accelerator" not in tail and "node check" not in tail
    assert lines[0] == "-- last lines of job.err:"
    assert lines[-1].endswith("finished at step 60: holdout AUC 0.8515")
    assert "job.out" not in tail  # nothing but noise there


def test_errors_lead_once_each_and_survive_a_reader_that_keeps_the_last_lines():
    err = "\n".join(["Traceback (most recent call last):", '  File "train.py", line 3', "ValueError: bad row",
                     *["rank0@n INFO hybridtrain: step"] * 80, "rank1@gpu-node-02 ERROR hybridtrain: a collective "
                     "operation failed", "srun: error: gpu-node-02: task 1: Exited with exit code 1",
                     "srun: error: gpu-node-02: task 1: Exited with exit code 1"])
    tail = readable_tail([("job.err", err), ("job.out", STDOUT)], 20)
    lines = tail.splitlines()
    assert len(lines) <= 20
    assert lines[:5] == ["-- the job's errors (4 of 4):", "Traceback (most recent call last):", "ValueError: bad row",
                         "rank1@gpu-node-02 ERROR hybridtrain: a collective operation failed",
                         "srun: error: gpu-node-02: task 1: Exited with exit code 1"]
    assert lines[-1] == "srun: error: gpu-node-02: task 1: Exited with exit code 1"


def test_empty_logs_say_so():
    assert readable_tail([("job.err", ""), ("job.out", "\n\n")], 40) == "(the job's logs are empty)"


def test_tails_of_several_files_come_back_in_one_command(tmp_path):
    """A job's logs and its recovery log in one round trip: a missing file reads empty, odd names stay whole."""
    import subprocess

    from hybridflow.utils.job_logs import parse_tails, tails_argv

    out, odd = tmp_path / "job-7.out", tmp_path / "a b; $(touch pwned)"
    out.write_text("one\ntwo\nthree\n")
    odd.write_text("x\n")
    printed = subprocess.run(tails_argv([str(out), str(tmp_path / "missing"), str(odd)], 2), capture_output=True,
                             text=True, check=True).stdout
    assert parse_tails(printed) == {str(out): "two\nthree\n", str(tmp_path / "missing"): "", str(odd): "x\n"}
    assert not (tmp_path / "pwned").exists() and parse_tails("") == {}
