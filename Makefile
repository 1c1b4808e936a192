# Two entry points for a fresh machine:
#   make demo   runs the whole pipeline on the embedded default (configs/local.yaml)
#   make test   runs the test suite
# Both create and use the project's virtualenv (.venv) by themselves.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.base-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: demo test venv clean-venv

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
	touch $@ $(BASE_STAMP)

venv: $(TEST_STAMP)

demo: $(BASE_STAMP)
	DS_ACCELERATOR=cpu $(VENV)/bin/drafter run --config configs/local.yaml

# pytest exits 5 when it collects nothing; that is not a failure here.
test: $(TEST_STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest -q tests; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

clean-venv:
	rm -rf $(VENV)
