# Two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NATIVE := build/native/manifest.json

.PHONY: demo test native lint clean

$(BIN)/kvgate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,native]'
	@touch $@

demo: $(BIN)/kvgate
	$(BIN)/kvgate demo

# The compiled hot path (kvgate_native.py): rebuilt whenever a package source changes; a
# stale or missing build is never loaded, kvgate then runs the same code as plain Python.
native: $(NATIVE)

$(NATIVE): $(BIN)/kvgate kvgate_native.py $(shell find extproc limiter -name '*.py')
	$(BIN)/python -m kvgate_native

# The suite runs twice: on the compiled modules (what `make native` deployments and the
# benchmarks run) and as plain Python (the fallback, and what an edited checkout runs).
test: $(BIN)/kvgate $(NATIVE)
	$(BIN)/ruff check .
	$(BIN)/pytest -q
	KVGATE_NATIVE=0 $(BIN)/pytest -q

lint: $(BIN)/kvgate
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .hypothesis
