"""A node's self-check before a training job's ranks start (see hybridtrain/node_check.py); run by the batch
script as one ``srun`` task per node. Exit 0: healthy; 79: a check failed (the line names the node and the check).

Usage: python jobs/node_check.py --checkpoint-dir DIR --gpus-per-node N [--min-free-gib G] [--scratch-dir PATH_WITH_%n]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from hybridtrain.launch import first_node, node_name
from hybridtrain.node_check import NODE_CHECK_FAILED, check_node, failure_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, type=Path)
    parser.add_argument("--gpus-per-node", required=True, type=int, help="GPUs allocated per node")
    parser.add_argument("--min-free-gib", type=float, default=1.0)
    parser.add_argument("--scratch-dir", default="", help="node-local scratch; %%n is the node's name")
    args = parser.parse_args(argv)
    node = node_name(os.environ, platform.node())
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    master = os.environ.get("MASTER_ADDR") or (first_node(nodelist) if "," in nodelist or "[" in nodelist else None)
    checks = check_node(node=node, gpus=args.gpus_per_node, checkpoint_dir=args.checkpoint_dir,
                        min_free_gib=args.min_free_gib, scratch_dir=args.scratch_dir, master=master)
    failed = [check for check in checks if not check.ok]
    if not failed:
        print(f"node check {node}: ok ({'; '.join(f'{c.name}: {c.detail}' for c in checks)})", flush=True)
    for check in failed:
        print(failure_line(node, check), file=sys.stderr, flush=True)
    return NODE_CHECK_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
