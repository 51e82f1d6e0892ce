# make test / make demo / make bench each create .venv when it is missing.
# torch is pinned to the local CPU wheel first, so no install can pull a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.remat-installed

.PHONY: test demo bench lint install docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n auto --maxprocesses=4 --dist worksteal

demo: $(STAMP)
	$(PY) -m remat demo

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m remat bench
	OMP_NUM_THREADS=1 $(PY) benchmarks/engine_overhead.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/pipeline_plan.py

lint: $(STAMP)
	$(PY) -m ruff check src tests

# the documentation site, into site/ (strict: a broken link or reference fails the build)
docs: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[docs]"
	$(PY) docs/build_readme.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
