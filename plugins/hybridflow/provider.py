"""Provider metadata read by Airflow's providers manager through the `apache_airflow_provider` entry point."""

from __future__ import annotations

from hybridflow import __version__


def get_provider_info() -> dict:
    return {
        "package-name": "hybridflow",
        "name": "Hybridflow",
        "description": "Hybrid ML pipelines: Spark on CPU, DeepSpeed on a Slurm GPU partition over SSH, "
                       "Triton serving.",
        "versions": [__version__],
        "connection-types": [
            {"connection-type": "triton", "hook-class-name": "hybridflow.hooks.triton.TritonHook"},
        ],
    }
