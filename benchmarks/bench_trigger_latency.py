"""trigger_latency: how long after a Slurm job ends does its Airflow task succeed?

Runs the platform_healthcheck DAG (Spark off) on the running local stack N times, one after another. Its
``slurm_gpu_job`` task is the deferrable SlurmSubmitOperator: the job's last line is ``ended_at=<epoch>`` and
the task's end_date comes from the REST API, so the figure covers how the end is seen (the batch shell's end
marker), and for a job that outlives the task's wait before deferring (``hold_s`` > 20 s) the triggerer handing
the event back, the scheduler queueing the resumed task and execute_complete finishing.

    benchmarks/bench_trigger_latency.py [RUNS] [HOLD_S]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from airflow_session import local_airflow  # noqa: E402
from hybridflow.utils.latency import percentile  # noqa: E402

DAG_ID = "platform_healthcheck"
TASK_ID = "slurm_gpu_job"


def job_ended_at(stdout_path: str) -> float:
    lines = [line for line in Path(stdout_path).read_text().splitlines() if line.startswith("ended_at=")]
    return float(lines[-1].split("=", 1)[1])


def main(runs: int = 10, hold_s: int = 0) -> dict:
    airflow = local_airflow()
    latencies = []
    for i in range(runs):
        run_id = airflow.trigger(DAG_ID, {"run_spark": False, "hold_s": hold_s})
        state = airflow.wait_for_run(DAG_ID, run_id, timeout_s=300)
        if state != "success":
            raise RuntimeError(f"{DAG_ID} run {run_id} ended {state}; see the Airflow UI")
        ti = airflow.task_instances.get_task_instance(DAG_ID, run_id, TASK_ID)
        result = airflow.xcom(DAG_ID, run_id, TASK_ID)
        latency = ti.end_date.timestamp() - job_ended_at(result["stdout_path"])
        latencies.append(latency)
        print(f"run {i + 1}/{runs}: job {result['job_id']} end -> task success {latency:.2f} s", flush=True)
    figures = {"runs": runs, "hold_s": hold_s, "median_s": round(statistics.median(latencies), 2),
               "p95_s": round(percentile(latencies, 95), 2), "max_s": round(max(latencies), 2),
               "samples_s": [round(x, 2) for x in latencies]}
    print(f"RESULT trigger_latency hold_s={hold_s} median_s={figures['median_s']} p95_s={figures['p95_s']}", flush=True)
    return figures


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
