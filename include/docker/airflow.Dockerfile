# syntax=docker/dockerfile:1.7
# Airflow with the hybridflow package baked in; build context is the repository root (docker-compose.yaml).
FROM apache/airflow:3.3.2-python3.11

# spark-submit runs the Spark driver inside Airflow (client mode) and needs a JVM.
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
USER airflow

# Laid out as in the repository so the editable install resolves to /opt/airflow/plugins/hybridflow: the
# image runs on its own, and under compose the bind-mounted ./plugins is the code that runs.
COPY --chown=airflow:0 pyproject.toml README.md /opt/airflow/
COPY --chown=airflow:0 plugins/hybridflow /opt/airflow/plugins/hybridflow

# Pinning apache-airflow keeps pip from moving the image's Airflow. torch comes from the CPU index: training
# runs on the Slurm GPU node, never here. pyspark-client overwrites pyspark's files, so pyspark is reinstalled
# last at the version the project resolved.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        "apache-airflow==${AIRFLOW_VERSION}" -e /opt/airflow \
 && pip install --no-cache-dir --no-deps --force-reinstall \
        "pyspark==$(python -c 'import importlib.metadata as m; print(m.version("pyspark"))')"

# The Spark master and worker run from this image too (docker-compose.yaml): executors then have the driver's
# Python, pandas, pyarrow, torch and hybridflow. SPARK_HOME is a stable path to the pyspark package, which
# holds bin/spark-class and the jars; find_spec locates it without importing it (or writing bytecode as root).
USER root
RUN pyspark_init="$(python -B -c 'import importlib.util as u; print(u.find_spec("pyspark").origin)')" \
 && ln -sfn "$(dirname "${pyspark_init}")" /opt/spark \
 && test -x /opt/spark/bin/spark-class \
 && test -d /opt/spark/jars
ENV SPARK_HOME=/opt/spark

# Airflow's entrypoint runs `airflow <command>` after waiting for the metadata database, so the Spark services
# use this one. It keeps what Spark needs from Airflow's: a passwd entry for an arbitrary UID (the JVM's
# Hadoop login fails without a user name) and umask 0002, so files written to the shared volume stay
# group-writable.
COPY --chmod=0755 <<'SCRIPT' /usr/local/bin/spark-entrypoint
#!/bin/bash
set -euo pipefail
umask 0002
if ! whoami &>/dev/null; then
  if [[ -w /etc/passwd ]]; then
    echo "spark:x:$(id -u):0:spark user:${AIRFLOW_USER_HOME_DIR}:/sbin/nologin" >> /etc/passwd
  fi
  export HOME="${AIRFLOW_USER_HOME_DIR}"
fi
exec "$@"
SCRIPT
USER airflow
