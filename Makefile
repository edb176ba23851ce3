# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Each creates .venv on first use and installs the project into it (CPU torch 2.13.0 first, so
# that the torch requirement never pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lagom-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## demo: build the sample corpus, then train a small GPT on 4 CPU processes (TP=2 x DP=2, then PP=2 x DP=2) with --lagom
demo: $(STAMP)
	$(PY) scripts/run_demo.py

## test: the whole test suite (CI runs exactly this)
test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

## test-min / test-max: the whole suite on the lowest / highest tested torch and megatron-core
## (each in its own virtual environment, .venv-min / .venv-max; PYTHON_MIN / PYTHON_MAX name the
## interpreters: megatron-core 0.17+ needs Python >= 3.12). The versions are those of
## lagom_megatron/megatron/versions.py; docs/training.md, "Tested versions".
PYTHON_MIN ?= python3.11
PYTHON_MAX ?= python3.12
.PHONY: test-min test-max
test-min:
	scripts/test_versions.sh .venv-min $(PYTHON_MIN) 2.6.0 0.16.1
test-max:
	scripts/test_versions.sh .venv-max $(PYTHON_MAX) 2.14.1 0.18.2
