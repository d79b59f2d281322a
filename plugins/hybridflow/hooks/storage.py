"""S3-compatible object storage through boto3, configured by an Airflow connection of type ``aws``."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from urllib.parse import urlparse

from airflow.sdk import BaseHook


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix``)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{uri!r} is not an s3://bucket/key URI")
    return parsed.netloc, parsed.path.lstrip("/")


class StorageHook(BaseHook):
    """
    The S3 calls the checkpoint store and the model repository make (list, read, hash, upload), on a boto3 client
    from the Amazon provider's ``S3Hook``: the ``aws`` connection's keys, role assumption, profile, region and
    ``extra.endpoint_url`` (S3-compatible stores: MinIO, the local stack's endpoint) work as Airflow users expect.

    :param storage_conn_id: Airflow connection of type ``aws``.
    """

    conn_name_attr = "storage_conn_id"
    default_conn_name = "storage_s3"
    conn_type = "aws"
    hook_name = "S3-compatible storage"

    def __init__(self, storage_conn_id: str = default_conn_name):
        super().__init__()
        self.storage_conn_id = storage_conn_id

    @cached_property
    def client(self):
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.storage_conn_id).get_conn()

    def get_conn(self):
        return self.client

    def list_keys(self, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under the prefix."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], obj["Size"]

    def list_prefixes(self, bucket: str, prefix: str) -> list[str]:
        """The next path level under the prefix ("directories")."""
        prefix = prefix.rstrip("/") + "/"
        names = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                                          Delimiter="/"):
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return names

    def read_text(self, bucket: str, key: str) -> str | None:
        try:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        except self.client.exceptions.NoSuchKey:
            return None

    def sha256(self, bucket: str, key: str) -> str:
        import hashlib

        digest = hashlib.sha256()
        for chunk in self.client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()

    def upload_file(self, path: str, bucket: str, key: str) -> None:
        self.client.upload_file(path, bucket, key)
