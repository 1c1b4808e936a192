# GPU image for training (DeepSpeed), evaluation, and the multi-node trainer workers
# (infra/k8s/trainer-workers.yaml: sshd for DeepSpeed's pdsh launcher).
#   docker build -f docker/trainer.Dockerfile -t drafter-trainer:0.1.0 .
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        build-essential git openssh-server openssh-client pdsh && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd && ssh-keygen -A
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/drafter
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY configs ./configs
# the CUDA 12.8 build of the torch version pyproject.toml pins; DeepSpeed and the rest from pyproject.toml
RUN pip install --no-cache-dir "torch==2.13.*" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install --no-cache-dir .
ENV DS_ACCELERATOR=cuda
ENTRYPOINT ["drafter"]
