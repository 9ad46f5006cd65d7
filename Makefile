# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv (torch/torchvision first: the versions served from this machine's disk;
# override TORCH_PINS for another build, e.g. PyTorch's CPU-only wheels, see the README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

.PHONY: setup demo readme-numbers test test-all lint bench clean distclean mutation

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

# The demo replaces its own output each time (and nothing else under runs/). Two threads
# on every machine: the README's numbers are those of this run (fedsgld/studies/readme_numbers.py).
demo: setup
	rm -rf runs/demo-dpsgld runs/demo-dpsgd runs/demo-compare.png
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgld --set threads=2 --out runs/demo-dpsgld
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgd --set threads=2 --out runs/demo-dpsgd
	$(BIN)/fedsgld compare runs/demo-dpsgld runs/demo-dpsgd --out runs/demo-compare.png
	$(BIN)/python -m fedsgld.studies.readme_numbers --print runs/demo-dpsgld runs/demo-dpsgd

# Rewrite the README's demo numbers from a fresh demo run (`--check` only compares).
readme-numbers: demo
	$(BIN)/python -m fedsgld.studies.readme_numbers runs/demo-dpsgld runs/demo-dpsgd

# The CI test command: every test, in two passes. First those not marked slow (under 10
# minutes on 2 cores), then every test marked slow: the README's full-size demo runs, the
# Ray simulations, sweeps and two-node cluster, the real deployments on loopback (stock,
# TLS with SuperNode authentication, the fast path, secure aggregation, a site's guard and
# code approval, a server with its own ServerApp), and the engine, audit and accounting
# tests of several seconds or more. No test is left out. A test that hangs fails after
# TEST_TIMEOUT seconds (pytest-timeout), and its fixtures still stop what it started.
# pytest exits 5 when it selects no test: never for the first pass (the fast suite is
# there); the second accepts it, with a note, should no test be marked slow. Both passes
# run on TEST_WORKERS pytest-xdist workers (each test whole on one worker; a free worker
# takes the next test): every test's processes, ports and directories are its own.
# `make test-all` runs every test in one pass.
TEST_TIMEOUT ?= 1200
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -m "not slow" -q --durations=15 --timeout=$(TEST_TIMEOUT) \
	  -n $(TEST_WORKERS) --dist worksteal
	$(BIN)/python -m pytest -m slow -q --durations=50 --timeout=$(TEST_TIMEOUT) \
	  -n $(TEST_WORKERS) --dist worksteal \
	  || { s=$$?; test $$s -eq 5 || exit $$s; echo "make test: no test is marked slow"; }

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check fedsgld tests benchmarks examples
	$(BIN)/ruff format --check fedsgld tests benchmarks examples
	$(BIN)/lint-imports

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

# Results and caches; the environment stays (`make distclean` removes it too).
clean:
	rm -rf runs .pytest_cache .ruff_cache build fedsgld.egg-info
	find fedsgld tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
