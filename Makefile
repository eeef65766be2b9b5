# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TYPECHECK := build/typecheck/terminus
# torch is pinned to the release whose CPU wheel this kind of machine serves locally;
# installing it before the project keeps pip from resolving a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint diagrams bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/terminus simulate

test: $(STAMP) $(TYPECHECK)
	$(BIN)/terminus diagrams --check
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 -q --fsm-coverage-fail-under 100

lint: $(STAMP) $(TYPECHECK)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The package as it installs (terminus/ = the root's __init__.py + the four folders), as
# links that mypy reads through (see [tool.mypy] in pyproject.toml).
$(TYPECHECK):
	mkdir -p $@
	ln -sfn ../../../__init__.py ../../../py.typed $@/
	for d in fsm states effects kernels metrics; do ln -sfn ../../../$$d $@/$$d; done

diagrams: $(STAMP)
	$(BIN)/terminus diagrams

bench: $(STAMP)
	$(BIN)/terminus bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
