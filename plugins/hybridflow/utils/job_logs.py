"""A Slurm job's log as on-call reads it: the job's own errors first, then its last lines without known noise.

Libraries print lines that say nothing about this job (DeepSpeed's accelerator detection, its config dumps,
Slurm's PMIx notice). A tail of the raw log shows those and hides the job's summary; this one drops them (and
says how many), and puts error lines (a traceback, an ERROR log line, srun's and the node check's errors) first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Lines known to carry nothing about the job (each measured in this suite's job logs).
NOISE = (
    re.compile(r"\[(?:WARNING|INFO)\]\s+\[real_accelerator\.py"),  # DeepSpeed: "Setting accelerator to CPU"
    re.compile(r"Setting ds_accelerator to"),
    re.compile(r"^\[[0-9-]+ [0-9:,]+\] \[INFO\] \[(?:config|engine|logging|utils|comm|torch)\.py"),  # DeepSpeed INFO
    re.compile(r"can not load PMIx library"),  # Slurm's mpi/pmix with MpiDefault=none
    re.compile(r"^node check \S+: ok \("),  # a healthy node's self-check line
)
ERROR = re.compile(r"\b(?:ERROR|CRITICAL)\b|Traceback \(most recent call last\)|^\w+(?:Error|Exception): "
                   r"|srun: error:|slurmstepd: error:|NODE CHECK FAILED|^STALL of Slurm job")
MAX_ERRORS = 10


def is_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in NOISE)


def readable_tail(sources: Sequence[tuple[str, str]], lines: int) -> str:
    """At most ``lines`` lines: the job's errors (at most ``MAX_ERRORS``, each once, in order), then the last lines
    of each log that are not noise, the rest of the budget shared between them. ``sources``: ``(path, text)`` of
    the job's logs, its stderr first. Within the budget, so a reader keeping the last N lines keeps the errors."""
    kept_by_source, errors = [], []
    for path, text in sources:
        non_empty = [line for line in text.splitlines() if line.strip()]
        kept = [line for line in non_empty if not is_noise(line)]
        for line in kept:
            if ERROR.search(line) and line not in errors:
                errors.append(line)
        kept_by_source.append((path, kept, len(non_empty) - len(kept)))
    shown_errors = errors[: min(MAX_ERRORS, max(lines // 2 - 1, 0))]
    out = [f"-- the job's errors ({len(shown_errors)} of {len(errors)}):", *shown_errors] if shown_errors else []
    with_lines = [entry for entry in kept_by_source if entry[1]]
    budget = (lines - len(out)) // max(len(with_lines), 1) - 1
    for path, kept, dropped in with_lines:
        note = f" ({dropped} line(s) of known library noise left out)" if dropped else ""
        out += [f"-- last lines of {path}{note}:", *kept[-max(budget, 1):]]
    return "\n".join(out) or "(the job's logs are empty)"


# Starts the section of each file in the output of ``tails_argv`` (a byte no log line holds).
_FILE_MARK = "\x1e"


def tails_argv(paths: Sequence[str], lines: int) -> list[str]:
    """One command printing the last ``lines`` lines of each file (a missing one prints nothing), read back with
    :func:`parse_tails`: a job's logs and its recovery log in one round trip."""
    script = 'n=$1; shift; for f; do printf "\\036%s\\n" "$f"; tail -n "$n" -- "$f" 2>/dev/null; done; true'
    return ["sh", "-c", script, "tails", str(lines), *paths]


def log_paths(*paths: str) -> list[str]:
    """A job's log files, each once (stderr and stdout may be one file), without the unset ones."""
    return list(dict.fromkeys(path for path in paths if path))


def readable_logs(paths: Sequence[str], tails: dict[str, str], lines: int) -> tuple[str, str]:
    """(the logs' last lines as searched text, the tail on-call reads) from :func:`parse_tails`'s result."""
    if not paths:
        return "", "(no log found)"
    sources = [(path, tails.get(path, "")) for path in paths]
    return "\n".join(text for _, text in sources), readable_tail(sources, lines)


def parse_tails(stdout: str) -> dict[str, str]:
    """path -> its last lines, from the output of :func:`tails_argv`."""
    tails: dict[str, str] = {}
    for section in stdout.split(_FILE_MARK)[1:]:
        path, _, text = section.partition("\n")
        tails[path] = text
    return tails
