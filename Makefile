# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TYPECHECK := build/typecheck/terminus
# torch is pinned to the release whose CPU wheel this kind of machine serves locally;
# installing it before the project keeps pip from resolving a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint diagrams bench mutants clean

# The engine's compiled core (fsm/_engine.c) is built by the install, in place; editing
# it makes the stamp stale, so `make setup` (and every target on it) builds it again.
$(STAMP): pyproject.toml fsm/_engine.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,dev]"
	# An editable install writes no bytecode (nor does Python where PYTHONDONTWRITEBYTECODE
	# is set): compiled here, as pip does for a wheel, each command does not compile
	# the package again (~0.3 s of every `terminus simulate`). A stale file is ignored.
	$(BIN)/python -m compileall -q __init__.py fsm states effects kernels metrics
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/terminus simulate

# The suite runs with the compiled core, then (where it was built) its engine part again
# with the Python core alone (TERMINUS_PURE_PYTHON=1: what a machine without a C compiler runs), leaving out
# the long simulations and explorations (a differential test compares whole simulations
# of the two cores) and what no core changes (the HTML report in a browser, the plugin).
PURE_SKIP := explore_seeds simulate sim_fastpaths sim_skeleton instructions \
	prefetch_collective coverage_plugin html_report
test: $(STAMP) $(TYPECHECK)
	$(BIN)/terminus diagrams --check
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 -q --fsm-coverage-fail-under 100
	@# (where the compiled core was not built, the run above was the Python core's)
	if $(BIN)/python -c 'import sys; from terminus.fsm import _core; sys.exit(_core.C is None)'; \
	then TERMINUS_PURE_PYTHON=1 $(BIN)/python -m pytest -n 2 -q \
		$(foreach t,$(PURE_SKIP),--ignore=tests/test_$(t).py); \
	else echo "the compiled core is not in use: the Python core ran the suite above"; fi

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

# Mutation score of the engine core and the kernels (README, "Test strength"); not in CI.
# `make mutants MUTANTS='terminus.fsm.ledger.* terminus.fsm.plan.*'` runs only those.
MUTMUT_DIR := build/mutmut
MUTANTS ?=
mutants: $(STAMP)
	rm -rf $(MUTMUT_DIR) && mkdir -p $(MUTMUT_DIR)/terminus
	cp -r __init__.py py.typed fsm states effects kernels metrics $(MUTMUT_DIR)/terminus/
	cp -r tests pyproject.toml $(MUTMUT_DIR)/
	find $(MUTMUT_DIR) -name __pycache__ -prune -exec rm -rf {} +
	# (the Python core is what is mutated: the compiled one is left out of the copy)
	find $(MUTMUT_DIR) -name '*.so' -delete
	cd $(MUTMUT_DIR) && TERMINUS_PURE_PYTHON=1 ../../$(BIN)/mutmut run --max-children 2 $(MUTANTS) || true
	cd $(MUTMUT_DIR) && ../../$(BIN)/python ../../tests/mutants_score.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
	rm -f fsm/_engine.*.so
