# SGLang servers (generation, capture, serving promoted drafters) and the benchmark stage, which
# starts baseline / NGRAM / EAGLE3 servers in turn on one 8-GPU node.
#   docker build -f docker/sglang.Dockerfile -t drafter-sglang:0.1.0 .
#
# SGLang 0.5.23's wheel pins torch==2.14.1, transformers==5.19.0, tokenizers==0.23.2 and CUDA 13
# (cuda-python>=13), while the pipeline's own environment pins torch 2.13, transformers 5.24.0 and
# tokenizers 0.23.3 (pyproject.toml). So this image is SGLang's environment, and the pipeline is added
# without those pins and without deepspeed (the `drafter` CLI: pull, verify, benchmark, and the
# generate/capture clients). One SGLang version for capture and serving: it must equal
# pipeline.engines.sglang.SGLANG_VERSION (tests/test_deploy.py checks this).
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04

ARG SGLANG_VERSION=0.5.23
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        build-essential git libnuma1 && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "sglang==${SGLANG_VERSION}"

WORKDIR /opt/drafter
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY configs ./configs
# The pipeline's requirements, SGLang's environment deciding what it already holds
# (docker/sglang_requirements.py): under a constraints file of that environment pip moves none of its
# packages, and `pip check` fails the build on any conflict that is left, where pip alone only warns.
ENV SGLANG_DECIDES="torch transformers tokenizers deepspeed"
COPY docker/sglang_requirements.py ./docker/sglang_requirements.py
RUN python docker/sglang_requirements.py pyproject.toml > /tmp/requirements.txt \
 && pip list --format=freeze > /tmp/sglang-environment.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt -c /tmp/sglang-environment.txt \
 && pip install --no-cache-dir --no-deps . \
 && pip check
# Not root: the pipeline image's user (uid 50000, group 0, as apache/airflow's), so that what one pod writes
# on the shared volumes another may replace (docs/RUNBOOK.md, the first deployment's checklist)
RUN useradd --uid 50000 --gid 0 --home-dir /home/drafter --create-home drafter
USER 50000
ENV DS_ACCELERATOR=cuda
# the project's files (configs/, infra/k8s/): the package itself is installed into site-packages
ENV DRAFTER_HOME=/opt/drafter
EXPOSE 30000
CMD ["python", "-m", "sglang.launch_server", "--help"]
