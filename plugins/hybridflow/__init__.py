"""hybridflow: Airflow 3 building blocks for ML pipelines across Spark, a Slurm GPU partition and Triton."""

__version__ = "0.1.0"
