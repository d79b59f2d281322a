"""An S3 endpoint for the storage tests: moto's server (the S3-compatible endpoint that runs here), in this process
on a port of its own, and a fresh bucket on it per test."""

from __future__ import annotations

import socket
import uuid

import pytest


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


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
