"""The training job's host synchronizations per step, counted on a CPU: ``python -m helpers.host_sync_job
SHORT.json LONG.json [SHORT.json LONG.json ...]`` (``jobs`` and ``tests`` on PYTHONPATH; under torchrun for several
ranks). Each pair is one run config at two ``max_steps``, trained from scratch one after the other in this process
under a :class:`~helpers.host_syncs.HostSyncCounter`; start-up, the final checkpoint, evaluation and export are
the same in both, so the difference is what the extra steps cost. Writes one file per pair and rank into the
working directory, ``hostsyncs-<LONG's run_id>-rank<r>.json``:
``{"config": <LONG's run_id>, "rank": r, "calls": [[kind, call site, count], ...]}``. A file of its own, not a line
on stdout: the ranks share torchrun's stdout, and one rank's long line was once cut by the other's log line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hybridtrain.preemption import StopRequest
from hybridtrain.runner import main as train_main

from helpers.host_syncs import HostSyncCounter


def count(config: str) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        code = train_main(["--config", config], stop=StopRequest())  # no signal handlers of its own
    if code != 0:
        raise SystemExit(f"training {config} exited {code}")
    return syncs


def main(configs: list[str]) -> None:
    for short, long in zip(configs[::2], configs[1::2], strict=True):
        added = count(long).calls - count(short).calls
        line = {"config": json.loads(open(long).read())["run_id"], "rank": int(os.environ.get("RANK", "0")),
                "calls": [[kind, site, n] for (kind, site), n in sorted(added.items())]}
        Path(f"hostsyncs-{line['config']}-rank{line['rank']}.json").write_text(json.dumps(line))


if __name__ == "__main__":
    main(sys.argv[1:])
