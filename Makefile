# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned to the release whose CPU wheel this kind of machine serves locally;
# installing it before the project keeps pip from resolving a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint typecheck diagrams bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/terminus simulate

test: $(STAMP)
	$(BIN)/terminus diagrams --check
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 -q --fsm-coverage-fail-under 100

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

diagrams: $(STAMP)
	$(BIN)/terminus diagrams

bench: $(STAMP)
	$(BIN)/terminus bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
