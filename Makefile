# Every target sets up .venv on first use; `make test` is all CI needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOBS ?= 2
WORKDIR ?= workdir/tiny
CONFIG ?= configs/tiny.py

.PHONY: help venv test test-slow test-aot aot-venv test-floors update-constraints lint format ding train decode bench clean

help:
	@echo "make train      train configs/tiny.py on the embedded 'ding' corpus into $(WORKDIR)"
	@echo "make decode     translate the ding test set with the model in $(WORKDIR)"
	@echo "make test       the fast test suite (CPU, offline)"
	@echo "make test-slow  the slow tests, then test-aot"
	@echo "make test-aot   compiles for TPU slices / GPUs (train.py --compile_for; builds .venv-aot)"
	@echo "make test-floors  the fast tests against the lowest versions pyproject.toml allows"
	@echo "make lint       ruff check + ruff format --check"
	@echo "make update-constraints  newest dependency versions into constraints.txt, then the tests"
	@echo "make bench      CPU benchmarks (JSON + table)"
	@echo "make gpu-suite OUT=DIR  GPU tests + benchmarks on a GPU machine, JSON into DIR (<10 min)"

# Installs are reproducible: exact versions from constraints.txt (see update-constraints).
CONSTRAINTS := constraints.txt
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[train,dev,serve]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m slow
	$(MAKE) test-aot

# Ahead-of-time compiles for TPU slices and GPUs (train.py --compile_for) need the
# compilers, jax[tpu] (libtpu) and jax[cuda13], at our jax version: they live in a side
# venv, never in .venv, where every `import jax` would then probe for a TPU. One
# compile at a time (each takes a core for up to minutes).
AOT := .venv-aot
AOT_STAMP := $(AOT)/.installed
JAX_VERSION = $(shell sed -n 's/^jax==//p' $(CONSTRAINTS))
$(AOT_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(AOT)/bin/python || $(PYTHON) -m venv $(AOT)
	$(AOT)/bin/python -m pip install -q --upgrade pip
	$(AOT)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[train,dev]' \
	  "jax[tpu]==$(JAX_VERSION)" "jax[cuda13]==$(JAX_VERSION)"
	touch $(AOT_STAMP)

aot-venv: $(AOT_STAMP)

test-aot: $(AOT_STAMP)
	$(AOT)/bin/python -m pytest -q -p no:xdist -m aot

# The fast suite in a second venv holding the *lowest* versions of our direct
# dependencies that pyproject.toml allows (uv's lowest-direct resolution), so that
# the lower bounds we publish are ones we have run.
FLOORS := .venv-floors
test-floors:
	test -x $(FLOORS)/bin/python || $(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install -q uv
	$(FLOORS)/bin/uv pip install -q -p $(FLOORS)/bin/python --resolution lowest-direct -e '.[train,dev]'
	$(FLOORS)/bin/python -m pytest -q -n $(JOBS) --dist loadfile

# Refresh constraints.txt to the newest releases pyproject.toml allows (in a scratch
# venv), then reinstall .venv from it and run the fast suite: commit the file if green.
LATEST := .venv-latest
update-constraints:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q -e '.[train,dev,serve]'
	{ head -3 $(CONSTRAINTS); $(LATEST)/bin/python -m pip freeze --exclude-editable \
	  | grep -v '^-e'; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(LATEST)
	$(MAKE) test

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The Ding dictionary (Debian/Ubuntu package trans-de-en) is the default corpus.
ding:
	@test -f /usr/share/trans/de-en || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "Installing the Ding dictionary (apt-get install trans-de-en)..."; \
	    (apt-get install -y -qq trans-de-en || (apt-get update -qq && apt-get install -y -qq trans-de-en)) >/dev/null; \
	  elif command -v sudo >/dev/null; then \
	    sudo apt-get install -y -qq trans-de-en; \
	  else \
	    echo "The default corpus needs /usr/share/trans/de-en: run 'apt-get install trans-de-en'," ; \
	    echo "or train on your own data with --config.dataset=tsv:FILE.tsv"; exit 1; \
	  fi; }

train: $(STAMP) ding
	$(PY) train.py --config=$(CONFIG) --workdir=$(WORKDIR)

decode: $(STAMP) ding
	$(PY) decode.py --workdir=$(WORKDIR) --split=test --output=$(WORKDIR)/test.hyp

bench: $(STAMP)
	$(PY) bench/input_pipeline.py
	$(PY) bench/train.py --configs=tiny
	$(PY) bench/decode.py --configs=tiny

# On a GPU machine (no venv needed: it uses python3, or $(PYTHON)): installs the wheels
# of bench/gpu/fetch_wheels.sh it lacks from .whl/, runs `pytest -m gpu` and the GPU benchmarks.
OUT ?= workdir/gpu-suite
.PHONY: gpu-suite
gpu-suite:
	PYTHON=$(PYTHON) bench/gpu/suite.sh $(OUT)

clean:
	rm -rf $(VENV) $(FLOORS) $(AOT) .pytest_cache .ruff_cache
