"""Code the test modules share, one module per topic; import it (``from helpers.rest import call``): pytest's config
(pyproject.toml) puts tests/ on the path. Fixtures stay in the conftest.py files, where pytest finds them.

- ``rest``: the Airflow REST API with every answer as (HTTP status, body), refusals included.
- ``waiting``: polling until a condition holds; a DAG run on a thread of its own while a test injects a fault.
- ``dag_runs``: the runner ``run_dag`` starts (``airflow_runner.py``, run as a script) and reading its result.
- ``slurm_dags``: the small one-task SlurmSubmitOperator DAG the Slurm tests run.
- ``triton``: export dirs as the training job writes them, the one-task deploy DAG, a client loop process.
- ``spark``: the Spark jobs submitted the way Airflow submits them; raw data from the project's generator.
- ``partitions``: published dataset partitions (manifest, rows).
- ``stack``: the local stack's services stopped and started again; its S3 endpoint.
- ``reliability``: the ``RELIABILITY`` figures line of the fault-injection tests.
- ``nested``: one value changed deep inside a nested dict.
"""
