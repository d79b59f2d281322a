"""MLflow, the suite's system of record: the hook owns every call to the tracking server.

It speaks MLflow's REST API (``/api/2.0/mlflow``, documented and versioned) with the connection's basic-auth
login, as Astronomer's MLflow provider does: MLflow's Python client takes credentials only from process-wide
environment variables, which one Airflow worker shared by many tasks must not set per connection. Artifacts go
through the server (``mlflow-artifacts``), so no task holds S3 keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook

from hybridflow.exceptions import MlflowUnavailable

# MLflow's limits for one runs/log-batch call
_BATCH_LIMITS = {"metrics": 1000, "params": 100, "tags": 100}


def _error_code(response) -> str:
    try:
        return str(response.json().get("error_code") or "")
    except ValueError:
        return ""


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MlflowHook(BaseHook):
    """
    One MLflow tracking server, from an ``http`` connection: host, port and schema (``http``/``https``) name it,
    login and password are the basic-auth user (the suite's own user, never the admin). Extra
    ``tracking_uri_on_cluster`` is the address compute nodes use where it differs from Airflow's.

    :param mlflow_conn_id: the connection (default ``mlflow_default``).
    :param timeout_s: network timeout of each call.
    """

    conn_name_attr = "mlflow_conn_id"
    default_conn_name = "mlflow_default"
    conn_type = "http"
    hook_name = "MLflow"

    def __init__(self, mlflow_conn_id: str = default_conn_name, timeout_s: float = 30) -> None:
        super().__init__()
        self.mlflow_conn_id = mlflow_conn_id
        self.timeout_s = timeout_s

    @cached_property
    def _connection(self):
        return self.get_connection(self.mlflow_conn_id)

    @cached_property
    def tracking_uri(self) -> str:
        conn = self._connection
        port = f":{conn.port}" if conn.port else ""
        return f"{conn.schema or 'http'}://{conn.host}{port}"

    @property
    def tracking_uri_on_cluster(self) -> str:
        return str(self._connection.extra_dejson.get("tracking_uri_on_cluster") or self.tracking_uri)

    def job_credentials(self) -> dict[str, str]:
        """What a training job logs in with (written 0600 into its run directory, never on a command line)."""
        return {"username": self._connection.login or "", "password": self._connection.password or ""}

    @cached_property
    def _session(self):
        import requests

        session = requests.Session()
        if self._connection.login:
            session.auth = (self._connection.login, self._connection.password or "")
        return session

    def _fix(self) -> str:
        return (f"check that the MLflow server at {self.tracking_uri} is up (`make status`; `make up` starts it) and "
                f"that connection {self.mlflow_conn_id!r} has its login")

    def call(self, method: str, endpoint: str, *, params: Mapping[str, Any] | None = None,
             payload: Mapping[str, Any] | None = None, missing_ok: bool = False,
             absent: Sequence[str] = (), forbidden_is_absent: bool = False) -> dict[str, Any] | None:
        """One REST call (``endpoint`` below /api/2.0/mlflow/); None for RESOURCE_DOES_NOT_EXIST when
        ``missing_ok``, for the error codes in ``absent``, and for HTTP 403 when ``forbidden_is_absent`` (the
        basic-auth app answers 403 for a registered model that does not exist). Raises MlflowUnavailable naming
        the server, the call and the fix."""
        import requests

        url = f"{self.tracking_uri}/api/2.0/mlflow/{endpoint}"
        try:
            response = self._session.request(method, url, params=params, json=payload, timeout=self.timeout_s)
        except requests.RequestException as error:
            raise MlflowUnavailable(
                f"MLflow {method} {endpoint}: {type(error).__name__}: {error}; {self._fix()}") from None
        if response.status_code in (400, 404) and _error_code(response) in (
                *absent, *(("RESOURCE_DOES_NOT_EXIST",) if missing_ok else ())):
            return None
        if response.status_code == 403:
            if forbidden_is_absent:
                return None
            raise MlflowUnavailable(
                f"MLflow refused {method} {endpoint} to user {self._connection.login!r} (HTTP 403): it has no "
                f"permission on that resource, or the resource does not exist (MLflow answers both alike); an MLflow "
                f"admin grants it (README 'The local stack'), connection {self.mlflow_conn_id!r} names the user")
        if response.status_code != 200:
            raise MlflowUnavailable(f"MLflow {method} {endpoint} answered HTTP {response.status_code}: "
                                    f"{response.text[:300]}; {self._fix()}")
        return response.json() if response.content else {}

    # --- experiments and runs -------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The experiment's id, created when missing (two creators at once: the loser reads the winner's)."""
        found = self.call("GET", "experiments/get-by-name", params={"experiment_name": name}, missing_ok=True)
        if found is not None:
            return found["experiment"]["experiment_id"]
        try:
            return self.call("POST", "experiments/create", payload={"name": name})["experiment_id"]
        except MlflowUnavailable as error:
            if "RESOURCE_ALREADY_EXISTS" not in str(error):
                raise
        return self.call("GET", "experiments/get-by-name", params={"experiment_name": name})["experiment"][
            "experiment_id"]

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        found = self.call("GET", "runs/get", params={"run_id": run_id}, missing_ok=True)
        return None if found is None else found["run"]

    def find_run_by_tag(self, experiment_id: str, key: str, value: str) -> dict[str, Any] | None:
        """The oldest live run of the experiment whose tag ``key`` is ``value`` (``value``: hex digits only, so
        the filter needs no escaping)."""
        if not value.isalnum():
            raise ValueError(f"tag value {value!r} for a run search must be alphanumeric")
        found = self.call("POST", "runs/search", payload={
            "experiment_ids": [experiment_id], "filter": f"tags.`{key}` = '{value}'",
            "run_view_type": "ACTIVE_ONLY", "max_results": 10, "order_by": ["attributes.start_time ASC"],
        })
        runs = found.get("runs") or []
        return runs[0] if runs else None

    def search_runs(self, experiment_name: str, filter_string: str, *, max_results: int = 200) -> list[dict[str, Any]]:
        """The newest runs of the experiment matching ``filter_string`` (MLflow's search syntax; the caller builds
        it from fixed text only); none when the experiment does not exist."""
        found = self.call("GET", "experiments/get-by-name", params={"experiment_name": experiment_name},
                          missing_ok=True)
        if found is None:
            return []
        result = self.call("POST", "runs/search", payload={
            "experiment_ids": [found["experiment"]["experiment_id"]], "filter": filter_string,
            "run_view_type": "ACTIVE_ONLY", "max_results": max_results, "order_by": ["attributes.start_time DESC"]})
        return result.get("runs") or []

    def create_run(self, experiment_id: str, run_name: str, tags: Mapping[str, str], start_time_ms: int) -> dict:
        payload = {"experiment_id": experiment_id, "run_name": run_name, "start_time": start_time_ms,
                   "tags": [{"key": k, "value": str(v)} for k, v in tags.items()]}
        return self.call("POST", "runs/create", payload=payload)["run"]

    def log_batch(self, run_id: str, *, metrics: Sequence[Mapping[str, Any]] = (),
                  params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None) -> None:
        """Metrics, params and tags in as few calls as MLflow's limits allow. Params are write-once in MLflow:
        logging the same value again is accepted, so a retry repeats them safely."""
        param_list = [{"key": k, "value": str(v)} for k, v in (params or {}).items()]
        tag_list = [{"key": k, "value": str(v)} for k, v in (tags or {}).items()]
        for kind, items in (("metrics", list(metrics)), ("params", param_list), ("tags", tag_list)):
            for chunk in _chunks(items, _BATCH_LIMITS[kind]):
                self.call("POST", "runs/log-batch", payload={"run_id": run_id, kind: list(chunk)})

    def metric_history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        """Every point of one metric, page by page."""
        points: list[dict[str, Any]] = []
        params: dict[str, Any] = {"run_id": run_id, "metric_key": key, "max_results": 25000}
        while True:
            found = self.call("GET", "metrics/get-history", params=params)
            points.extend(found.get("metrics") or [])
            if not found.get("next_page_token"):
                return points
            params["page_token"] = found["next_page_token"]

    def logged_steps(self, run_id: str, keys: Iterable[str]) -> dict[str, set[int]]:
        """For each metric key, the steps the run holds a point for."""
        return {key: {int(point.get("step", 0)) for point in self.metric_history(run_id, key)}
                for key in sorted(set(keys))}

    def set_status(self, run_id: str, status: str) -> None:
        self.call("POST", "runs/update", payload={"run_id": run_id, "status": status})

    def finish_run(self, run_id: str, status: str, end_time_ms: int) -> None:
        self.call("POST", "runs/update", payload={"run_id": run_id, "status": status, "end_time": end_time_ms})

    # --- the model registry ---------------------------------------------------------------------------------

    def create_registered_model(self, name: str, tags: Mapping[str, str] | None = None,
                                description: str = "") -> bool:
        """Creates the registered model; False when it exists already (the call is atomic on the server, which
        makes it the registry's lock too)."""
        payload = {"name": name, "description": description,
                   "tags": [{"key": k, "value": str(v)} for k, v in (tags or {}).items()]}
        return self.call("POST", "registered-models/create", payload=payload,
                         absent=("RESOURCE_ALREADY_EXISTS",)) is not None

    def registered_model(self, name: str) -> dict[str, Any] | None:
        """The registered model, or None when it does not exist (or this user may not see it)."""
        found = self.call("GET", "registered-models/get", params={"name": name}, missing_ok=True,
                          forbidden_is_absent=True)
        return None if found is None else found["registered_model"]

    def delete_registered_model(self, name: str) -> None:
        """Deletes it; nothing when it does not exist."""
        self.call("DELETE", "registered-models/delete", payload={"name": name}, missing_ok=True,
                  forbidden_is_absent=True)

    def alias_version(self, name: str, alias: str) -> dict[str, Any] | None:
        """The model version ``alias`` points at, or None when it points nowhere (MLflow answers 400) or the
        registered model does not exist yet (the basic-auth app answers 403)."""
        found = self.call("GET", "registered-models/alias", params={"name": name, "alias": alias},
                          missing_ok=True, absent=("INVALID_PARAMETER_VALUE",), forbidden_is_absent=True)
        return None if found is None else found["model_version"]

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self.call("POST", "registered-models/alias", payload={"name": name, "alias": alias, "version": str(version)})

    def model_version(self, name: str, version: int) -> dict[str, Any] | None:
        found = self.call("GET", "model-versions/get", params={"name": name, "version": str(version)},
                          missing_ok=True, forbidden_is_absent=True)
        return None if found is None else found["model_version"]

    def search_model_versions(self, name: str, *, run_id: str | None = None) -> list[dict[str, Any]]:
        """Every version of ``name`` (of one run when ``run_id`` is given), oldest first. ``name`` must be a
        registry name (letters, digits, '_', '-', '.') and ``run_id`` hex: the filter needs no escaping."""
        if not all(ch.isalnum() or ch in "_-." for ch in name) or (run_id is not None and not run_id.isalnum()):
            raise ValueError(f"cannot search versions of {name!r} (run {run_id!r}): unexpected characters")
        condition = f"name='{name}'" + (f" and run_id='{run_id}'" if run_id else "")
        versions: list[dict[str, Any]] = []
        params: dict[str, Any] = {"filter": condition, "max_results": 1000}
        while True:
            found = self.call("GET", "model-versions/search", params=params)
            versions.extend(found.get("model_versions") or [])
            if not found.get("next_page_token"):
                return sorted(versions, key=lambda v: int(v["version"]))
            params["page_token"] = found["next_page_token"]

    def create_model_version(self, name: str, *, source: str, run_id: str, tags: Mapping[str, str],
                             description: str = "") -> dict[str, Any]:
        payload = {"name": name, "source": source, "run_id": run_id, "description": description,
                   "tags": [{"key": k, "value": str(v)} for k, v in tags.items()]}
        return self.call("POST", "model-versions/create", payload=payload)["model_version"]

    def set_model_version_tags(self, name: str, version: int, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.call("POST", "model-versions/set-tag",
                      payload={"name": name, "version": str(version), "key": key, "value": str(value)})

    # --- artifacts (proxied by the server) ------------------------------------------------------------------

    def upload_artifact(self, artifact_uri: str, path: str, content: bytes) -> None:
        """Put ``content`` at ``path`` under the run's artifact root (``mlflow-artifacts:/...``)."""
        import requests

        if not artifact_uri.startswith("mlflow-artifacts:"):
            raise MlflowUnavailable(f"run artifact root {artifact_uri!r} is not served by the tracking server; "
                                    "start it with --serve-artifacts")
        root = artifact_uri.removeprefix("mlflow-artifacts:").lstrip("/").rstrip("/")
        url = f"{self.tracking_uri}/api/2.0/mlflow-artifacts/artifacts/{root}/{path.lstrip('/')}"
        try:
            response = self._session.put(url, data=content, timeout=max(self.timeout_s, 300))
        except requests.RequestException as error:
            raise MlflowUnavailable(f"MLflow artifact upload of {path}: {error}; {self._fix()}") from None
        if response.status_code != 200:
            raise MlflowUnavailable(f"MLflow artifact upload of {path} answered HTTP {response.status_code}: "
                                    f"{response.text[:300]}; {self._fix()}")

    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.tracking_uri}/#/experiments/{experiment_id}/runs/{run_id}"

    def test_connection(self) -> tuple[bool, str]:
        try:
            self.call("POST", "experiments/search", payload={"max_results": 1})
        except MlflowUnavailable as error:
            return False, str(error)
        return True, f"MLflow at {self.tracking_uri} answers as {self._connection.login or 'anonymous'}"
