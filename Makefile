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

.PHONY: setup demo readme-numbers test test-all lint bench clean distclean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

# The demo replaces its own output each time (and nothing else under runs/). Two threads
# on every machine: the README's numbers are those of this run (fedsgld/tools/readme_numbers.py).
demo: setup
	rm -rf runs/demo-dpsgld runs/demo-dpsgd runs/demo-compare.png
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgld --set threads=2 --out runs/demo-dpsgld
	$(BIN)/fedsgld simulate simulations/demo.toml --set method=dpsgd --set threads=2 --out runs/demo-dpsgd
	$(BIN)/fedsgld compare runs/demo-dpsgld runs/demo-dpsgd --out runs/demo-compare.png

# Rewrite the README's demo numbers from a fresh demo run (`--check` only compares).
readme-numbers: demo
	$(BIN)/python -m fedsgld.tools.readme_numbers runs/demo-dpsgld runs/demo-dpsgd

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

# Results and caches; the environment stays (`make distclean` removes it too).
clean:
	rm -rf runs .pytest_cache .ruff_cache build fedsgld.egg-info
	find fedsgld tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
