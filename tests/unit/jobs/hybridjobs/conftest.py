"""For the storage tests: a fresh bucket per test on the S3 endpoint (``s3_endpoint``, tests/conftest.py), and a
real Spark in local mode, one per test module (a JVM start is the expensive part)."""

from __future__ import annotations

import os
import sys
import uuid

import pytest


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A new bucket on the endpoint and the access that opens it: ``(bucket, S3Access)``."""
    import boto3
    from hybridjobs.objectstore import S3Access

    keys = {"AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret-key-9f3a"}
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)
    return bucket, S3Access.from_environment({**keys, "AWS_ENDPOINT_URL": s3_endpoint})


@pytest.fixture(scope="module")
def spark():
    from hybridjobs.spark import build_session
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    # The Python workers run this venv's interpreter (pyarrow), as spark-submit's do on the stack.
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # local[2, 2]: two cores, and a failed task is tried once more (test_sparkio retries one).
    session = build_session("test-sparkio", {"spark.master": "local[2, 2]", "spark.ui.enabled": "false",
                                             "spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()
    SparkSession._instantiatedSession = None
    # The JVM would otherwise live, holding its heap, until this pytest process ends (the rest of its lane).
    SparkContext._gateway.shutdown()
    SparkContext._gateway = SparkContext._jvm = None
    if saved is None:
        os.environ.pop("PYSPARK_PYTHON")
    else:
        os.environ["PYSPARK_PYTHON"] = saved
