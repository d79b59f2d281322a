"""The run report task: gathers what each stage measured (its XCom) and publishes HTML + PNG + JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from hybridflow.ui import RunReportLink

if TYPE_CHECKING:
    from airflow.sdk import Context

# Where the nightly DAG's stages leave their figures.
NIGHTLY_SOURCES = {
    "quality": "quality.quality_gate",
    "preflight": "preflight.allreduce_preflight",
    "training": "training.train",
    "evaluation": "evaluation.champion_challenger",
    "deploy": "deploy.deploy_model",
}


class RunReportOperator(BaseOperator):
    """
    Writes ``<storage>/reports/<dag_id>/ds=<ds>/<run>/report.{html,json}`` and charts for the run, linked from
    the task ("Run report"). Only figures the stages measured appear; a missing one says why.

    :param sources: section -> task id whose XCom holds that stage's result (see NIGHTLY_SOURCES).
    """

    operator_extra_links = (RunReportLink(),)
    ui_color = "#e8f5e9"

    def __init__(self, *, sources: Mapping[str, str] = NIGHTLY_SOURCES, **kwargs):
        super().__init__(**kwargs)
        self.sources = dict(sources)

    def pull(self, context: Context, section: str, key: str = "return_value") -> Any:
        task_id = self.sources.get(section)
        return context["ti"].xcom_pull(task_ids=task_id, key=key) if task_id else None

    def execute(self, context: Context) -> dict:
        from pathlib import Path

        from hybridflow.config import pipeline_config
        from hybridflow.pipeline.nightly import training_figures
        from hybridflow.pipeline.nightly_tasks import read_cluster_json, scoring_figures
        from hybridflow.pipeline.report import write_report

        config = pipeline_config()
        ds, run_id, dag_id = context["ds"], context["run_id"], context["dag"].dag_id
        quality = self.pull(context, "quality") or {}
        train = self.pull(context, "training")
        metrics = read_cluster_json(config, f"{train['run_dir']}/metrics.json") if train else None
        decision = self.pull(context, "evaluation")
        deploy = self.pull(context, "deploy") or self.pull(context, "deploy", key="deploy_report")
        figures = {
            "dag_id": dag_id, "run_id": run_id, "ds": ds,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "features": quality.get("figures"),
            "quality": {"passed": quality["summary"]["failed"] == 0,
                        "checks": [{"name": c.get("check"), "column": c.get("column"), "observed": c.get("observed"),
                                    "expected": c.get("expected"), "passed": c.get("status") != "failed"}
                                   for c in quality.get("checks", [])]} if quality else None,
            "training": training_figures(train, metrics, self.pull(context, "preflight")),
            "evaluation": _evaluation(decision),
            "scoring": scoring_figures(config, ds),
            "deploy": deploy,
        }
        relative = config.storage.layout.report_path(dag_id, ds, run_id)
        report_dir = Path(config.storage.layout.report_dir(dag_id, ds, run_id))
        written = write_report(report_dir, figures, config.costs, p99_slo_ms=config.serving.slo_p99_ms)
        self.log.info("Run report: %s (not measured: %s)", written["html"],
                      [item.get("figure") or item for item in written.get("not_measured", [])] or "none")
        return {**{k: v for k, v in written.items() if k in ("dir", "json", "html", "charts")},
                "url_path": f"{relative}/report.html"}


def _evaluation(decision: Mapping[str, Any] | None) -> dict | None:
    if not decision:
        return None
    return {key: decision.get(key) for key in ("challenger", "champion", "decision", "margin", "reason")}


def report_sections() -> Sequence[str]:
    return tuple(NIGHTLY_SOURCES)
