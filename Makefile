# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Each creates .venv on first use and installs the project into it, after a CPU torch (below).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lagom-installed

# torch goes in first, as a CPU build, so that the project's torch requirement never pulls a CUDA build
# (several GB) unasked; a torch already in $(VENV) is kept as it is, and the project is installed beside it.
# pip's resolution of torch==$(TORCH_CPU) (--dry-run --report) tells the builds apart: a CUDA build brings
# nvidia-* and cuda-* distributions. The configured package index is asked first (it has CPU wheels for
# macOS and Windows; for Linux, PyPI's are CUDA builds), then PyTorch's CPU index; else make stops and
# says what to do. TORCH_CUDA_OK=1 takes whatever the configured index offers.
TORCH_CPU := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CUDA_OK ?=
CPU_BUILD = -c 'import json, sys; names = [d["metadata"]["name"].lower() for d in json.load(sys.stdin)["install"]]; sys.exit("torch" not in names or any(n.startswith(("nvidia-", "cuda-")) for n in names))'
TORCH_IN_VENV = -c 'import importlib.metadata as m; print(m.version("torch"))'
PIP_FAILED = make: installing into $(VENV) failed (above); 'make clean' removes $(VENV), then run make again

.PHONY: demo test lint install clean

# The Python version pyproject.toml requires (requires-python = ">=X.Y"), checked before anything is installed.
MIN_PY := $(shell sed -n 's/^requires-python *= *">= *\([0-9.]*\)".*/\1/p' pyproject.toml)
PY_OK = -c 'import sys; sys.exit(0 if sys.version_info[:2] >= tuple(map(int, "$(MIN_PY)".split("."))) else 1)'
PY_VERSION = -c 'import platform; print(platform.python_version())'

# A $(VENV) whose python no longer runs (deleted, or its interpreter gone) or is too old is repaired by the
# rule below however new its stamp is: the stamp then depends on a target that is always out of date.
VENV_OK := $(shell [ ! -e $(STAMP) ] || $(PY) $(PY_OK) 2>/dev/null && echo ok)
.PHONY: venv-broken
venv-broken: ;

$(STAMP): pyproject.toml $(if $(VENV_OK),,venv-broken)
	@$(PYTHON) $(PY_OK) 2>/dev/null || { \
	  found=$$($(PYTHON) $(PY_VERSION) 2>/dev/null) && found="is Python $$found" || found="does not run (not found, or not a Python)"; \
	  echo "make: $(PYTHON) $$found; lagom-megatron needs Python >= $(MIN_PY) (pyproject.toml): run make again with PYTHON=python$(MIN_PY) (or newer)" >&2; exit 2; }
	@if [ -e $(VENV) ] && ! $(PY) $(PY_OK) 2>/dev/null; then \
	  echo "make: $(VENV) is broken or made with another Python ($$($(PY) $(PY_VERSION) 2>/dev/null || echo 'its python does not run')); removing it and creating it again" >&2; \
	  rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip || { echo "$(PIP_FAILED)" >&2; exit 2; }
	@if kept=$$($(PY) $(TORCH_IN_VENV) 2>/dev/null); then \
	  echo "make: keeping torch $$kept, found in $(VENV)"; \
	elif [ "$(TORCH_CUDA_OK)" = 1 ]; then \
	  $(PY) -m pip install -q torch==$(TORCH_CPU); \
	elif $(PY) -m pip install -q --dry-run --report - torch==$(TORCH_CPU) 2>/dev/null | $(PY) $(CPU_BUILD) 2>/dev/null; then \
	  $(PY) -m pip install -q torch==$(TORCH_CPU); \
	elif $(PY) -m pip install -q --dry-run --report - --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_CPU) 2>/dev/null | $(PY) $(CPU_BUILD) 2>/dev/null; then \
	  $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_CPU); \
	else \
	  echo "make: no CPU build of torch $(TORCH_CPU) for Python $$($(PY) $(PY_VERSION)) (the package index offers a CUDA build or none, and $(TORCH_CPU_INDEX) cannot be reached or has none): install the torch you want into $(VENV) first ($(VENV)/bin/pip install ...) and run make again, or run make again with TORCH_CUDA_OK=1 to take the CUDA build (several GB)" >&2; exit 2; \
	fi || { echo "$(PIP_FAILED)" >&2; exit 2; }
	@$(PY) -m pip install -q -e '.[test]' "torch==$$($(PY) $(TORCH_IN_VENV))" || { echo "$(PIP_FAILED)" >&2; exit 2; }
	touch $(STAMP)

install: $(STAMP)

## demo: build the sample corpus, then train a small GPT on 4 CPU processes (TP=2 x DP=2, then PP=2 x DP=2) with --lagom
demo: $(STAMP)
	$(PY) scripts/run_demo.py

## test: the whole test suite (CI runs lint, then this)
test: $(STAMP)
	$(PY) -m pytest -q tests

## lint: ruff's checks and its formatter, as configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check lagom_megatron tests scripts
	$(VENV)/bin/ruff format --check lagom_megatron tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

## test-min / test-max: the whole suite on the lowest / highest tested torch and megatron-core
## (each in its own virtual environment, .venv-min / .venv-max; PYTHON_MIN / PYTHON_MAX name the
## interpreters: megatron-core 0.17+ needs Python >= 3.12). The ranges are those of
## lagom_megatron/megatron/hooks/versions.py; test-max takes torch's top minor and the newest
## megatron-core release in range (docs/training.md, "Tested versions").
PYTHON_MIN ?= python3.11
PYTHON_MAX ?= python3.12
.PHONY: test-min test-max
test-min:
	scripts/test_versions.sh .venv-min $(PYTHON_MIN) 2.6.0 0.16.1
test-max:
	scripts/test_versions.sh .venv-max $(PYTHON_MAX) 2.15.0 0.19.2
