# The pipeline image: the `drafter` CLI, stages that need no GPU (prompts, dataset, gate, promote, pull),
# and the Airflow DAGs. Build from the repository root:
#   docker build -f docker/pipeline.Dockerfile -t drafter-pipeline:0.1.0 .
FROM apache/airflow:3.3.2-python3.11

USER root
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
USER airflow

WORKDIR /opt/drafter
COPY --chown=airflow pyproject.toml README.md ./
COPY --chown=airflow pipeline ./pipeline
# the triggers the triggerer imports by classpath (the retraining watches); not from the DAGs folder
COPY --chown=airflow drafter_triggers ./drafter_triggers
COPY --chown=airflow configs ./configs
# train.launcher kubernetes: the train task's pod (this image) creates the node pods' Job from this file, and
# `configure` reads its GPUs for the run's usage (train.kubernetes_job, relative to DRAFTER_HOME)
COPY --chown=airflow infra/k8s/trainer-workers.yaml ./infra/k8s/trainer-workers.yaml
# CPU torch for the control plane; GPU stages run in docker/trainer.Dockerfile.
RUN pip install --no-cache-dir "torch==2.13.*" --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir ".[airflow]"
COPY --chown=airflow dags /opt/airflow/dags
# the project's files (configs/, infra/k8s/): the package itself is installed into site-packages
ENV DRAFTER_HOME=/opt/drafter
