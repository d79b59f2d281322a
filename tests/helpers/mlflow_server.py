"""The stack's MLflow tracking server as the tests read it: REST with the suite's own login (raw HTTP, so a test
sees the server's answers, not the hook's)."""

from __future__ import annotations

import requests

API = "/api/2.0/mlflow"


class Mlflow:
    """The tracking server as the tests read it (the suite's own user)."""

    def __init__(self, stack):
        self.uri = stack["MLFLOW_TRACKING_URI"]
        self.auth = (stack["MLFLOW_TRACKING_USERNAME"], stack["MLFLOW_TRACKING_PASSWORD"])
        self.password = stack["MLFLOW_TRACKING_PASSWORD"]

    def get(self, endpoint: str, **params) -> dict:
        response = requests.get(f"{self.uri}{API}/{endpoint}", params=params, auth=self.auth, timeout=30)
        assert response.status_code == 200, f"{endpoint}: {response.status_code} {response.text}"
        return response.json()

    def runs(self, experiment: str) -> list[dict]:
        response = requests.get(f"{self.uri}{API}/experiments/get-by-name", params={"experiment_name": experiment},
                                auth=self.auth, timeout=30)
        if response.status_code == 404:
            return []
        experiment_id = response.json()["experiment"]["experiment_id"]
        found = requests.post(f"{self.uri}{API}/runs/search", json={"experiment_ids": [experiment_id],
                              "max_results": 100}, auth=self.auth, timeout=30).json()
        return found.get("runs") or []

    def history(self, run_id: str, key: str) -> list[dict]:
        return self.get("metrics/get-history", run_id=run_id, metric_key=key).get("metrics") or []

    def artifacts(self, run_id: str, path: str) -> dict[str, int]:
        files = self.get("artifacts/list", run_id=run_id, path=path).get("files") or []
        return {f["path"]: int(f.get("file_size") or 0) for f in files if not f["is_dir"]}

    def model_version(self, name: str, version: int | str) -> dict:
        return self.get("model-versions/get", name=name, version=str(version))["model_version"]

    def alias(self, name: str, alias: str) -> dict | None:
        response = requests.get(f"{self.uri}{API}/registered-models/alias", params={"name": name, "alias": alias},
                                auth=self.auth, timeout=30)
        return response.json()["model_version"] if response.status_code == 200 else None
