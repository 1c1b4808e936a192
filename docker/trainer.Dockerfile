# GPU image for training (DeepSpeed under torchrun), evaluation, and the node pods of multi-node training
# (infra/k8s/trainer-workers.yaml, which the train stage reads to create their Job).
#   docker build -f docker/trainer.Dockerfile -t drafter-trainer:0.1.0 .
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        build-essential git && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/drafter
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY configs ./configs
COPY infra/k8s/trainer-workers.yaml ./infra/k8s/trainer-workers.yaml
# the CUDA 12.8 build of the torch version pyproject.toml pins; DeepSpeed and the rest from pyproject.toml
RUN pip install --no-cache-dir "torch==2.13.*" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install --no-cache-dir .
# Not root: the pipeline image's user (uid 50000, group 0, as apache/airflow's), so that what one pod writes
# on the shared volumes another may replace (docs/RUNBOOK.md, the first deployment's checklist)
RUN useradd --uid 50000 --gid 0 --home-dir /home/drafter --create-home drafter
USER 50000
ENV DS_ACCELERATOR=cuda
# the project's files (configs/, infra/k8s/): the package itself is installed into site-packages
ENV DRAFTER_HOME=/opt/drafter
ENTRYPOINT ["drafter"]
