# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv (torch/torchvision first: the versions served from this machine's disk).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

.PHONY: setup demo test test-all lint bench clean mutation

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgld --out runs/demo-dpsgld
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgd --out runs/demo-dpsgd

# The CI test command: everything except tests marked slow, then a representative slow one
# (the full-size demo run against the README's numbers). `make test-all` runs every test.
SLOW_SUBSET ?= tests/engine/test_readme_numbers.py::test_demo_dpsgld_matches_the_readme
test: setup
	$(BIN)/python -m pytest -m "not slow" -q
	$(BIN)/python -m pytest -q $(SLOW_SUBSET)

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check fedsgld tests benchmarks
	$(BIN)/ruff format --check fedsgld tests benchmarks

bench: setup
	$(BIN)/python benchmarks/step_speed.py

# Mutation testing (mutmut, configured under [tool.mutmut] in pyproject.toml) of the
# privacy-critical code against the fast in-process tests that call it. Not run in CI: it
# takes tens of minutes on 2 cores. It works in a copy of the tree under MUTATION_DIR and
# keeps its results there, so a second run only re-tests what changed. MUTANTS narrows the
# run to mutant-name globs, e.g. MUTANTS='fedsgld.privacy.* fedsgld.core.*'.
MUTATION_DIR ?= runs/mutation
MUTATION_JOBS ?= 2
MUTANTS ?=
mutation: setup
	mkdir -p $(MUTATION_DIR)
	rm -rf $(MUTATION_DIR)/fedsgld $(MUTATION_DIR)/tests
	cp -r fedsgld tests pyproject.toml $(MUTATION_DIR)/
	cd $(MUTATION_DIR) && OMP_NUM_THREADS=1 $(abspath $(BIN))/mutmut run --max-children $(MUTATION_JOBS) $(foreach m,$(MUTANTS),'$(m)')
	cd $(MUTATION_DIR) && $(abspath $(BIN))/mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json
	@echo "surviving mutants (inspect one with: cd $(MUTATION_DIR) && mutmut show NAME):"
	cd $(MUTATION_DIR) && $(abspath $(BIN))/mutmut results

clean:
	rm -rf $(VENV) runs .pytest_cache
