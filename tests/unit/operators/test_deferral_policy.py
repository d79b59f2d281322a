"""One deferral policy: every deferrable operator and sensor of the suite takes Airflow's ``[operators]
default_deferrable`` when its DAG does not say (the local stack and docker-compose set it true)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DEFAULTS = """
import inspect, json
from hybridflow.operators.slurm import SlurmSubmitOperator
from hybridflow.operators.training import DeepSpeedTrainingOperator, GenerationSlurmSubmitOperator
from hybridflow.operators.triton import TritonDeployOperator
from hybridflow.sensors.checkpoint import CheckpointSensor
from hybridflow.sensors.slurm import SlurmCapacitySensor

def default(cls):
    for klass in cls.__mro__:
        parameter = inspect.signature(klass.__init__).parameters.get("deferrable")
        if parameter is not None:
            return parameter.default
print(json.dumps({cls.__name__: default(cls) for cls in (SlurmSubmitOperator, DeepSpeedTrainingOperator,
      GenerationSlurmSubmitOperator, TritonDeployOperator, CheckpointSensor, SlurmCapacitySensor)}))
"""


@pytest.mark.parametrize("setting", ["True", "False"])
def test_every_deferrable_operator_and_sensor_follows_airflows_setting(setting):
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW__")}
    env["AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"] = setting
    out = subprocess.run([sys.executable, "-c", DEFAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    defaults = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(defaults) == 6 and set(defaults.values()) == {setting == "True"}, defaults
