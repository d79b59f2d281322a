"""The installed distribution: pins that are known to break, the provider entry point, plugin isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_packaging_pyspark_files_are_4_3_0_not_overwritten_by_pyspark_client():
    """pyspark-client (pulled by the Spark provider) overwrites pyspark's files with 4.2.0, whose Python UDFs
    over Parquet hang; `make venv` re-installs pyspark 4.3.0 last."""
    import pyspark

    assert metadata.version("pyspark") == "4.3.0"
    assert pyspark.__version__ == "4.3.0", "pyspark files were overwritten: run `make venv` again"


def test_packaging_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__.startswith("2.13.0")
    assert not torch.cuda.is_available() or os.environ.get("HYBRIDFLOW_EXPECT_GPU")


def test_packaging_pandas_below_3_for_pyspark():
    assert int(metadata.version("pandas").split(".")[0]) < 3


def test_packaging_provider_entry_point_declares_the_triton_connection_type():
    (entry,) = [e for e in metadata.entry_points(group="apache_airflow_provider") if e.value.startswith("hybridflow")]
    info = entry.load()()
    assert info["package-name"] == "hybridflow"
    types = {c["connection-type"]: c["hook-class-name"] for c in info["connection-types"]}
    assert types == {"triton": "hybridflow.hooks.triton.TritonHook"}
    module, _, cls = types["triton"].rpartition(".")
    hook = getattr(__import__(module, fromlist=[cls]), cls)
    assert hook.conn_type == "triton"


def test_packaging_airflow_plugin_loader_loads_only_the_ui_plugin(tmp_path):
    """Airflow imports every .py under plugins/ by bare file name; .airflowignore keeps our package out, so the
    one plugin file (the UI pages) is all it loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False")
    out = subprocess.run([str(Path(sys.executable).parent / "airflow"), "plugins", "--output", "json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plugins = json.loads(out.stdout[out.stdout.index("["):])
    assert [p["name"] for p in plugins] == ["hybridflow_ui"]
    assert plugins[0]["fastapi_apps"][0]["url_prefix"] == "/hybridflow"
    assert "Failed to import plugin" not in out.stdout + out.stderr
    assert "hybridflow/" in (REPO / "plugins" / ".airflowignore").read_text()
