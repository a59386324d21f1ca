# The two commands a newcomer needs: `make demo` and `make test`. Both create .venv
# (when missing or when pyproject.toml changed) and install fedkit with its dev extra.
# Bytecode is compiled once, on all cores, after the install: every Ray actor, Flower
# node and `fedkit run` subprocess then starts in half the time, even where
# PYTHONDONTWRITEBYTECODE keeps Python from caching what it compiles.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint format reference docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip uninstall -q -y fedkit 2>/dev/null || true  # the name before fedkit-fl
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]' 2>&1 | { grep -v 'is ignored: it is neither' || true; }
	$(BIN)/python -m compileall -qq -j 0 -x "/tests?/" "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" fedkit plugins || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedkit run quickstart --out runs/quickstart-demo-$$(date +%Y%m%d-%H%M%S)

# Three pytest workers of one torch thread each (a whole test file per worker, so its
# module fixtures stay with it). On two cores a third worker fills the time the others
# wait on processes they started (Ray, Flower, `fedkit run`): 674 s against 868 s for two.
# Files go out in collection order, the slowest first (tests/conftest.py).
test: $(STAMP) lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/pytest -n $${TEST_WORKERS:-3} --dist loadfile --no-loadscope-reorder

# The loop between edits: ruff, then every test not marked `slow`, i.e. none that starts a
# subprocess, Ray or Flower, builds a wheel, runs a tutorial or takes over about 1.5 s
# (tests/test_test_layout.py keeps process-starting tests marked). About a minute on 2
# cores against `make test`'s ten; `make test` stays the whole suite and what CI runs.
# Two workers, not three: these tests never wait on a process, so a third only adds its
# imports (9 s more, measured); tests go out one at a time (xdist's default), not by file.
check: $(STAMP) lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/pytest -m "not slow" -n $${CHECK_WORKERS:-2}

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

reference: $(STAMP)
	$(BIN)/python -m fedkit.cli.reference docs

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
