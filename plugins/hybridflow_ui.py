"""Airflow plugin: mounts hybridflow's pages (run reports, Slurm job records) on the api-server under /hybridflow.
The code lives in the installed package (hybridflow.ui); this file only registers it."""

from airflow.plugins_manager import AirflowPlugin
from hybridflow.timetables import NoMissedRunCronTimetable
from hybridflow.ui import URL_PREFIX, create_app


class HybridflowUiPlugin(AirflowPlugin):
    name = "hybridflow_ui"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "hybridflow reports and Slurm jobs"}]
    # The GPU partition ledger's page, in the UI's Browse menu (shown inside the UI at /plugin/gpu-utilization).
    external_views = [{"name": "GPU utilization", "href": f"{URL_PREFIX}/utilization", "destination": "nav",
                       "category": "browse", "url_route": "gpu-utilization"}]
    # Custom timetables deserialize only when a plugin lists them (scheduler, api-server, DAG processor).
    timetables = [NoMissedRunCronTimetable]
