"""A stage fails on purpose and on-call gets one alert that says what they need: DAG, run, stage, remote job id,
the last log lines and the runbook; another run's failure of the same stage within the window is sent too.

The DAGs run through Airflow's real task lifecycle (dag.test in a subprocess, see tests/integration/conftest.py),
with retries off so the failure callback fires at once; the alerts go to the local sink, a file per test."""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

from hybridflow.hooks.slurm import SlurmHook

REPO = Path(__file__).resolve().parents[2]


def alerts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_failed_slurm_stage_alerts_with_job_id_log_tail_and_runbook_once(run_dag, stack, tmp_path, monkeypatch):
    sink = tmp_path / "alerts.jsonl"
    dag_id = f"t_alert_{uuid.uuid4().hex[:6]}"
    source = textwrap.dedent(f'''
        from datetime import datetime
        from airflow.sdk import DAG, TaskGroup
        from hybridflow.notifiers.oncall import OnCallNotifier
        from hybridflow.operators.slurm import SlurmSubmitOperator
        with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
                 default_args={{"retries": 0, "on_failure_callback": OnCallNotifier(alerts_file="{sink}")}}):
            with TaskGroup("training"):
                SlurmSubmitOperator(
                    task_id="train",
                    command=["bash", "-c", "echo step 10 loss 0.4; echo CUDA out of memory >&2; exit 3"],
                    partition="gpu-training", gpus_per_node=1, time_limit=2, requeue=False, signal=None,
                    log_dir="{stack["HYBRIDFLOW_STORAGE_ROOT"]}/runs/test-alerts/logs", poll_interval_s=2,
                )
    ''')
    first = run_dag(source, dag_id)
    assert first["state"] == "failed"
    sent = alerts(sink)
    assert len(sent) == 1, sent
    alert = sent[0]
    assert alert["dag_id"] == dag_id and alert["task_id"] == "training.train" and alert["stage"] == "training"
    assert alert["run_id"].startswith("manual__")
    assert alert["runbook"] == "include/runbooks/training.md" and (REPO / alert["runbook"]).is_file()
    assert alert["job_id"] and alert["job_id"].isdigit()
    assert "CUDA out of memory" in alert["log_tail"]
    hook = SlurmHook()
    try:
        assert hook.status(alert["job_id"]).state == "FAILED"
    finally:
        hook.close()

    # Another run failing at the same stage within the window is another incident: alerted too (dedup is per DAG,
    # stage and run; a run failing again at the same stage is suppressed: tests/unit/notifiers/test_oncall_notifier.py).
    second = run_dag(source, dag_id)
    assert second["state"] == "failed"
    sent = alerts(sink)
    assert len(sent) == 2, sent
    assert sent[1]["stage"] == "training" and sent[1]["run_id"] != alert["run_id"]
    assert "suppressed" not in second["log"]


def test_nightly_features_failure_alerts_with_the_features_runbook(run_dag, stack, tmp_path):
    """The real nightly DAG with a corrupt raw partition: the Spark stage fails and the alert points at it."""
    ds = "2025-05-05"
    raw = Path(stack["HYBRIDFLOW_STORAGE_ROOT"]) / "raw" / f"ds={ds}"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "part-00000.parquet").write_bytes(b"this is not parquet")
    (raw / "_MANIFEST.json").write_text(json.dumps({"dataset": "raw", "ds": ds, "row_count": 1}))
    (raw / "_SUCCESS").write_text("")
    sink = tmp_path / "alerts.jsonl"
    source = (REPO / "dags" / "nightly_training.py").read_text() + textwrap.dedent(f'''
        from hybridflow.notifiers.oncall import OnCallNotifier
        for _task in dag.tasks:  # fail at once, and alert into this test's own sink
            _task.retries = 0
            _task.on_failure_callback = [OnCallNotifier(alerts_file="{sink}")]
    ''')
    try:
        # train=never: only the features stage may fail (on a fresh stack the all-reduce gate would fail too).
        result = run_dag(source, "nightly_training", conf={"train": "never", "deploy": "never"},
                         logical_date=f"{ds}T00:00:00+00:00")
    finally:
        for path in raw.iterdir():
            path.unlink()
        raw.rmdir()
    assert result["state"] == "failed"
    sent = alerts(sink)
    assert [a["stage"] for a in sent] == ["features"], sent
    assert sent[0]["runbook"] == "include/runbooks/features.md"
    assert sent[0]["task_id"] == "features.build_features" and sent[0]["dag_id"] == "nightly_training"
    assert "spark-submit" in sent[0]["error"] or "Cannot execute" in sent[0]["error"]
