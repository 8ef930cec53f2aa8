# Two entry points, each building a fresh virtual environment (.venv) on first use:
#   make run    installs and runs the main job (lens-parallel decompose on smollm2-135m)
#   make test   installs and runs the whole test suite on two pytest-xdist workers of one thread each (the Ray tests
#               on one of them: one local cluster), after Debian's Chromium (the browser test) and bubblewrap (the
#               sandbox for model-written code) when missing and we are allowed to: root or passwordless sudo;
#               otherwise it stops and says what to install
#   make test-shuffled   the whole suite in a shuffled order (pytest-randomly; SEED=N repeats an order), to show that no
#                        test depends on the order tests run in
#   make test-compat   the fast tier on the oldest versions the dependency ranges allow (scripts/test-compat, its own
#                      .venv-oldest); `make test-fast` is the newest end
#   make test-fast   the inner loop: the unit and integration tiers only (no browser, smollm2, notebooks, CLI
#                    subprocesses or Ray), on two pytest-xdist workers of one thread each: about 3 minutes here
#   make docs   the documentation site from docs/ (mkdocs-material, the API reference from the docstrings, the
#               notebooks executed for their outputs and figures, about 2 minutes; make docs EXECUTE=0 skips that)
#               into site/, strictly: a broken link or a missing reference fails
# torch is pinned to the 2.13.0 CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lens_parallel-installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,distributed,notebook,tasks,quantization,docs]'
	touch $(STAMP)

.PHONY: install run test test-fast test-compat test-shuffled lint bench docs
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lens-parallel decompose --space value value-exclude-self residual-attn --out results/decompose

test: $(STAMP)
	@bash scripts/ensure-system-packages
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup

test-shuffled: $(STAMP)
	@bash scripts/ensure-system-packages
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup -p randomly $(if $(SEED),--randomly-seed=$(SEED),)

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "unit or integration" -n 2

test-compat:
	bash scripts/test-compat

lint: $(STAMP)
	$(VENV)/bin/ruff check lens_parallel tests benchmarks scripts notebooks
	$(VENV)/bin/ruff format --check lens_parallel tests benchmarks scripts notebooks

docs: $(STAMP)
	LENS_PARALLEL_DOCS_EXECUTE=$(if $(filter 0,$(EXECUTE)),false,true) NO_MKDOCS_2_WARNING=1 \
		$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/decompose_overhead.py
