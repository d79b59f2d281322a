"""Two trainings, then an evaluation, in one process, as benchmarks/bench_gpu.py runs them: a finished training tears
its process group down through DeepSpeed's comm layer, so the next one starts a group of its own instead of meeting
DeepSpeed's clone of the destroyed world group ("Group ... is not registered"). Its own process: the training job
sets the process's environment and logging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.feature_partitions import write_features

REPO = Path(__file__).resolve().parents[4]
SCRIPT = """
import json, sys
import evaluate
import torch.distributed as dist
from hybridtrain.preemption import StopRequest
from hybridtrain.runner import main

features, *configs = sys.argv[1:]
trainings = []
for config in configs:
    code = main(["--config", config], stop=StopRequest())
    trainings.append({"code": code, "group_left": dist.is_initialized()})
challenger, champion = (json.load(open(config))["run_dir"] + "/export/model.pt" for config in configs[::-1])
evaluation = evaluate.evaluate(features, ("2026-01-01",), challenger, champion, 0.2)
print("RESULT " + json.dumps({"trainings": trainings, "evaluation": evaluation}))
"""


def test_two_trainings_then_an_evaluation_run_in_one_process(tmp_path):
    write_features(tmp_path / "features", "2026-01-01", seed=0, customers=1500)
    configs = []
    for name, seed in (("first", 7), ("second", 8)):
        configs.append(tmp_path / f"{name}.json")
        configs[-1].write_text(json.dumps({
            "run_id": name, "features_root": str(tmp_path / "features"), "ds": ["2026-01-01"],
            "run_dir": str(tmp_path / name), "model": {"preset": "tiny"}, "max_steps": 6, "batch_size": 32,
            "learning_rate": 0.01, "checkpoint_every_steps": 6, "seed": seed, "zero_stage": 0,
            "deepspeed_config": str(REPO / "include" / "deepspeed" / "zero0.json"), "log_every_steps": 2,
            "torch_threads": 1,
        }))
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "jobs"), str(REPO / "tests")])
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "features"), *map(str, configs)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["trainings"] == [{"code": 0, "group_left": False}] * 2
    for name in ("first", "second"):
        loop = json.loads((tmp_path / name / "metrics.json").read_text())["loop"]
        assert (loop["from_step"], loop["to_step"]) == (2, 6) and loop["rows_per_s"] > 0
    evaluation = result["evaluation"]
    assert evaluation["holdout_rows"] > 0 and evaluation["champion"]["auc"] != evaluation["challenger"]["auc"]
    assert set(evaluation["phases_s"]) == {"read", "hash", "load", "score", "metrics"}
