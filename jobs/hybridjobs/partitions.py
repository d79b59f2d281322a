"""Published partitions under a storage root, on either scheme (a POSIX folder or ``s3://bucket/prefix``): where
one lies, whether it is published, its rows and its features manifest. No Spark here, so the raw generator and
the checks that only read manifests stay light; ``datasets`` adds Spark's readers and writers on top."""

from __future__ import annotations

from typing import Any

from hybridjobs import manifests, objectstore, storage
from hybridjobs.layout import StorageLayout


def on_object_store(root: str) -> bool:
    return root.startswith("s3://")


def partition_uri(root: str, dataset: str, ds: str) -> str:
    return StorageLayout(root.rstrip("/")).partition(dataset, ds)


def read_manifest(root: str, dataset: str, ds: str) -> dict[str, Any]:
    """The published manifest of a partition on the object store.

    :raises objectstore.PartitionNotPublished: no whole partition there.
    """
    uri = partition_uri(root, dataset, ds)
    return objectstore.read_manifest(objectstore.open_uri(uri))


def is_published(root: str, dataset: str, ds: str) -> bool:
    if not on_object_store(root):
        return storage.is_published(partition_uri(root, dataset, ds))
    try:
        read_manifest(root, dataset, ds)
        return True
    except objectstore.PartitionNotPublished:
        return False


def table_rows(root: str, dataset: str, ds: str, table_name: str | None = None,
               manifest: dict[str, Any] | None = None) -> int:
    """Rows of a published partition (of its table ``table_name``): the manifest's parts (``manifest`` when the
    caller has read it already), or the files' footers on POSIX."""
    if on_object_store(root):
        manifest = manifest or read_manifest(root, dataset, ds)
        return sum(part["rows"] for part in objectstore.parts_of(manifest, table_name))
    return manifests.parquet_rows(manifests.partition_files(partition_uri(root, dataset, ds), table_name or ""))


def read_features_manifest(root: str, ds: str) -> dict[str, Any]:
    """The published features manifest of ``ds``, with the fields every reader of features relies on checked.

    :raises storage.PartitionNotPublishedError: not published.
    :raises storage.ManifestError: naming each bad field and the fix.
    """
    uri = partition_uri(root, "features", ds)
    if not on_object_store(root):
        return storage.read_features_manifest(uri)
    try:
        manifest = read_manifest(root, "features", ds)
    except objectstore.PartitionNotPublished as error:
        raise storage.PartitionNotPublishedError(f"{uri} is not published: {error}; run the features job for this "
                                                 f"ds first") from None
    return storage.check_features_manifest(manifest, f"{uri}/{storage.MANIFEST_NAME}")
