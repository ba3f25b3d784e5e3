# pdq: two commands. `make up` starts a local cluster; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel; a bare `torch` requirement on a fresh venv would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# Two test processes (pytest-xdist), a test file each at a time: most tests wait on servers they
# started, so two share a 2-core machine well. PYTEST_ARGS= runs them in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: up test install protos docs clean bench

up: install
	$(VENV)/bin/pdq up $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

protos: install
	$(PY) -m pdq.ops.protogen

docs: install
	$(PY) -m pdq.ops.configdoc

bench: install
	$(VENV)/bin/pdq bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# BENCHMARKS.md and benchmarks/plots/ from benchmarks/sections.yaml and the result JSON under benchmarks/.
.PHONY: benchmarks
benchmarks: install
	$(PY) -m pdq.bench.benchmarks_doc
