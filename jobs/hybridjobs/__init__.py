"""Code shared by the Spark jobs in ``jobs/``; it never imports Airflow or hybridflow.

How it reaches the processes that need it:
- the driver: each job script puts its own directory (``jobs/``) first on ``sys.path``;
- the Python workers on the executors: the job calls :func:`hybridjobs.spark.ship_package` right after its
  session starts, which zips this package and registers it with ``SparkContext.addPyFile``. So
  ``spark-submit jobs/<name>.py ...`` needs no ``--py-files``; shipping a zip of this package with
  ``--py-files`` as well is harmless.

Modules: ``storage`` (partition layout, manifests, atomic publish; stdlib only), ``generator`` (raw data,
numpy + pyarrow, no Spark), ``features`` and ``scoring`` (Spark), ``manifests`` (figures of written Parquet,
pyarrow on the driver), ``spark`` (session helpers), ``objectstore`` (any storage URI, a local path or ``s3://``,
through pyarrow, and the partition commit protocol that holds on an object store), ``sparkio`` (Spark datasets
on any such URI with no Hadoop S3 connector: the tasks write parts, the driver commits by manifest).
"""
