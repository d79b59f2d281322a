"""Pure pieces of healing a Slurm job: which failure class a job's end belongs to, and the job's recovery log.

The table is config (``recovery.failure_classes`` in pipeline.yaml, :class:`~hybridflow.config.FailureClass`);
the first class whose every given criterion matches decides. The recovery log
(``<log_dir>/<job name>.recovery.jsonl`` on the cluster) holds one JSON line per thing done to heal a job (a
stall, a requeue, an excluded node), so a retried task, a restarted worker and the run report count the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

UNCLASSIFIED = "unclassified"
UNCLASSIFIED_RUNBOOK = "training.md#unclassified"


@dataclass(frozen=True)
class Verdict:
    """A failed job's class, the action it calls for and the runbook section."""

    name: str
    action: str
    runbook: str

    def describe(self) -> str:
        return f"failure class {self.name} (action {self.action}; runbook include/runbooks/{self.runbook})"


def classify(classes: Mapping[str, Any], *, state: str, exit_code: int | None, signal: int | None,
             log_text: str) -> Verdict:
    """The first class of ``classes`` (in order; rows shaped like :class:`hybridflow.config.FailureClass`) that
    matches the job's end; ``unclassified`` (retry) if none."""
    for name, row in classes.items():
        if row.states and state not in row.states:
            continue
        if row.exit_codes and exit_code not in row.exit_codes:
            continue
        if row.signals and signal not in row.signals:
            continue
        if row.log_pattern and not re.search(row.log_pattern, log_text):
            continue
        return Verdict(name, row.action, row.runbook)
    return Verdict(UNCLASSIFIED, "retry", UNCLASSIFIED_RUNBOOK)


def recovery_log_path(log_dir: str, job_name: str) -> str:
    return f"{log_dir.rstrip('/')}/{job_name}.recovery.jsonl"


def parse_recovery_log(text: str | None) -> list[dict]:
    """The records of a recovery log; a line that is not a JSON object (a torn write) is skipped."""
    records = []
    for line in (text or "").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def recovery_line(record: Mapping) -> str:
    return json.dumps(dict(record), sort_keys=True, separators=(",", ":")) + "\n"


def excluded_nodes(records: Iterable[Mapping]) -> list[str]:
    """Every node a record excluded, in order, once each."""
    nodes: list[str] = []
    for record in records:
        if record.get("kind") == "exclude_node" and record.get("node") and record["node"] not in nodes:
            nodes.append(str(record["node"]))
    return nodes


_NODE_CHECK_RE = re.compile(r"NODE CHECK FAILED on (?P<node>[A-Za-z0-9._-]+): (?P<check>[^:\n]+): (?P<detail>[^\n]*)")
_SRUN_EXIT_RE = re.compile(r"srun: error: (?P<node>[A-Za-z0-9._-]+): task \d+: Exited with exit code (?P<code>\d+)")


def unhealthy_node(log_text: str, exit_code: int | None) -> tuple[str, str, str] | None:
    """``(node, check, what is wrong)`` of the first node that failed its self-check (jobs/node_check.py's line),
    else the node srun names for the check's exit code; None when the log names no node."""
    match = _NODE_CHECK_RE.search(log_text)
    if match:
        return match.group("node"), match.group("check").strip(), match.group("detail").strip()
    for match in _SRUN_EXIT_RE.finditer(log_text):
        if exit_code is not None and int(match.group("code")) == exit_code:
            return match.group("node"), "unknown", f"its self-check exited {exit_code}"
    return None
