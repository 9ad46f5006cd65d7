# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv (torch/torchvision first: the versions served from this machine's disk).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

.PHONY: setup demo test test-all lint bench clean

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

clean:
	rm -rf $(VENV) runs .pytest_cache
