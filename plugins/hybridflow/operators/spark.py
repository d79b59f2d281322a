"""The Spark provider's operator for the suite's stages, which read and write the storage root."""

from __future__ import annotations

from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseHook

from hybridflow.config import pipeline_config
from hybridflow.exceptions import HybridflowError
from hybridflow.hooks.storage_root import StorageRoot


class StorageSparkSubmitOperator(SparkSubmitOperator):
    """``SparkSubmitOperator`` whose driver gets the storage root's access: on an ``s3://`` root the standard AWS
    variables from the storage connection (``storage.conn_id``), resolved when the task runs, so no key is in the
    DAG, the rendered fields or spark-submit's command line; the driver hands its tasks what they need
    (jobs/hybridjobs/sparkio.py). A local root adds nothing.

    On YARN or Kubernetes the Spark provider would pass these variables as ``--conf`` on the command line: there
    the cluster's own identity (instance profile, IRSA) must reach the bucket, and this operator refuses to
    hand over keys.
    """

    def execute(self, context: Any) -> None:
        storage = pipeline_config().storage
        access = StorageRoot(storage.root, storage.conn_id).job_environment()
        if access:
            master = BaseHook.get_connection(self._conn_id).host or ""
            if master.startswith(("yarn", "k8s://")):
                raise HybridflowError(
                    f"storage.root {storage.root} on Spark master {master}: the Spark provider would put the keys of "
                    f"connection {storage.conn_id!r} on spark-submit's command line; give the cluster an identity "
                    f"that reaches the bucket (instance profile, IRSA) instead")
            from airflow.sdk.log import mask_secret

            for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
                if name in access:
                    mask_secret(access[name])
            self.env_vars = {**(self.env_vars or {}), **access}
        super().execute(context)
