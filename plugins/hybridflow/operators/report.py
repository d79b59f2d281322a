"""The run report task: gathers what each stage measured (its XCom) and publishes HTML + PNG + JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from hybridflow.pipeline.nightly import NightlyTask
from hybridflow.ui import RunReportLink

if TYPE_CHECKING:
    from airflow.sdk import Context

# Where the nightly DAG's stages leave their figures.
NIGHTLY_SOURCES = {
    "plan": NightlyTask.PLAN,  # the training placement (CPU or GPU) and whether the run trains
    "prepare": NightlyTask.PREPARE,  # the evaluation placement
    "quality": NightlyTask.QUALITY_GATE,
    "preflight": NightlyTask.ALLREDUCE_PREFLIGHT,
    "training": NightlyTask.TRAIN,
    "evaluation": NightlyTask.CHAMPION_CHALLENGER,
    "deploy": NightlyTask.DEPLOY_MODEL,
    "release": NightlyTask.FINISH_RELEASE,
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

    def _history(self, config, dag_id: str) -> list | None:
        """The last nights of this DAG's training runs in MLflow; None (said in the report) when MLflow does not
        answer or no connection names it: the report is written anyway."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        from hybridflow.exceptions import MlflowUnavailable
        from hybridflow.hooks.mlflow import MlflowHook
        from hybridflow.ui import is_dag_id
        from hybridflow.utils.mlflow_tracking import nightly_history

        if not is_dag_id(dag_id):  # it goes into the search filter
            return None
        try:
            runs = MlflowHook().search_runs(config.nightly.mlflow_experiment,
                                            f"tags.`hybridflow.dag_id` = '{dag_id}' and attributes.status = 'FINISHED'")
        except (MlflowUnavailable, AirflowNotFoundException) as error:
            self.log.warning("no 'last 30 nights' chart: %s", error)
            return None
        return nightly_history(runs)

    def execute(self, context: Context) -> dict:
        import tempfile
        from pathlib import Path

        from hybridflow.config import pipeline_config
        from hybridflow.layout import TrainingRunDir
        from hybridflow.pipeline.nightly import placement_figures, training_figures
        from hybridflow.pipeline.nightly_tasks import read_cluster_json, scoring_figures, storage_root
        from hybridflow.pipeline.report import HTML_NAME, JSON_NAME, write_report

        config = pipeline_config()
        ds, run_id, dag_id = context["ds"], context["run_id"], context["dag"].dag_id
        quality = self.pull(context, "quality") or {}
        train = self.pull(context, "training")
        metrics = read_cluster_json(config, TrainingRunDir(train["run_dir"]).metrics) if train else None
        decision = self.pull(context, "evaluation")
        plan, prepared = self.pull(context, "plan") or {}, self.pull(context, "prepare") or {}
        deploy = (self.pull(context, "release", key="deploy_report") or self.pull(context, "deploy")
                  or self.pull(context, "deploy", key="deploy_report"))
        figures = {
            "dag_id": dag_id, "run_id": run_id, "ds": ds,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "features": quality.get("figures"),
            "quality": {"passed": quality["summary"]["failed"] == 0,
                        "checks": [{"name": c.get("check"), "column": c.get("column"), "observed": c.get("observed"),
                                    "expected": c.get("expected"), "passed": c.get("status") != "failed"}
                                   for c in quality.get("checks", [])]} if quality else None,
            "placement": placement_figures(plan.get("placement") if plan.get("train") else None,
                                           prepared.get("evaluation_placement")),
            "training": training_figures(train, metrics, self.pull(context, "preflight")),
            "evaluation": _evaluation(decision),
            "record": _record(train, decision, config.nightly.mlflow_experiment, self._history(config, dag_id)),
            "scoring": scoring_figures(config, ds),
            "deploy": deploy,
        }
        relative = config.storage.layout.report_path(dag_id, ds, run_id)
        report_uri = config.storage.layout.report_dir(dag_id, ds, run_id)
        store = storage_root(config)
        if store.on_object_store:  # drawn here, then copied up with report.json last
            with tempfile.TemporaryDirectory(prefix="hybridflow-report-") as scratch:
                drawn = write_report(Path(scratch) / "report", figures, config.costs,
                                     p99_slo_ms=config.serving.slo_p99_ms)
                store.publish_folder(Path(drawn["dir"]), report_uri, last=JSON_NAME)
            written = {**drawn, "dir": report_uri, "json": f"{report_uri}/{JSON_NAME}",
                       "html": f"{report_uri}/{HTML_NAME}",
                       "charts": [f"{report_uri}/{Path(chart).name}" for chart in drawn["charts"]]}
        else:
            written = write_report(Path(report_uri), figures, config.costs, p99_slo_ms=config.serving.slo_p99_ms)
        self.log.info("Run report: %s (not measured: %s)", written["html"],
                      [item.get("figure") or item for item in written.get("not_measured", [])] or "none")
        return {**{k: v for k, v in written.items() if k in ("dir", "json", "html", "charts")},
                "url_path": f"{relative}/report.html"}


def _evaluation(decision: Mapping[str, Any] | None) -> dict | None:
    if not decision:
        return None
    return {key: decision.get(key) for key in ("challenger", "champion", "decision", "margin", "reason")}


def _record(train: Mapping[str, Any] | None, decision: Mapping[str, Any] | None, experiment: str,
            history: list | None) -> dict | None:
    """The run's place in MLflow: its training run, the model version it registered and the nights before it
    (None: not tracked)."""
    tracked = (train or {}).get("mlflow")
    if not tracked:
        return {"history": history} if history is not None else None
    registered = decision.get("registered_version") if decision else None
    return {"run_id": tracked.get("run_id"), "run_url": tracked.get("url"), "experiment": experiment,
            "model_version": registered, "model_uri": decision.get("model_uri") if registered else None,
            "promoted": decision.get("promoted_version") is not None if registered else None, "history": history}


def report_sections() -> Sequence[str]:
    return tuple(NIGHTLY_SOURCES)
