# Two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NATIVE := build/native/manifest.json

.PHONY: demo test native lint clean

# kvgate's own dependencies at the versions the image installs (deploy/constraints.txt)
$(BIN)/kvgate: pyproject.toml deploy/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c deploy/constraints.txt -e '.[test,native]'
	@touch $@

demo: $(BIN)/kvgate
	$(BIN)/kvgate demo

# The compiled hot path (kvgate_native.py): rebuilt whenever a package source changes; a
# stale or missing build is never loaded, kvgate then runs the same code as plain Python.
native: $(NATIVE)

$(NATIVE): $(BIN)/kvgate kvgate_native.py $(shell find extproc limiter -name '*.py')
	$(BIN)/python -m kvgate_native

# The whole suite runs on the compiled modules (what the image, `make native` deployments and
# the benchmarks run); then again as plain Python (the fallback, and what an edited checkout
# runs) the tests that exercise the compiled modules' logic directly: the unit tests, the
# Redis tests that hold the stores' answers (and the compiled wire format) to the in-memory
# core's, and one end-to-end file. The other end-to-end tests add the I/O around that logic
# (Envoy, sockets, the coroutine modules, never compiled), and so do the Redis fault and
# replica tests, the benchmarks' own tests and the CLI's process handling: they run once.
PLAIN_TESTS := tests/unit tests/e2e/test_gateway.py \
	tests/integration/test_redis_store.py tests/integration/test_redis_fairness.py \
	tests/integration/test_rls_redis.py \
	--ignore=tests/unit/bench --ignore=tests/unit/extproc/test_cli.py \
	--ignore=tests/unit/extproc/test_processes.py \
	--ignore=tests/unit/extproc/test_startup_sigterm.py
# Both passes run on TEST_WORKERS processes (pytest-xdist): most end-to-end tests wait on
# Envoy, Redis and the clock more than they compute, so two workers on two cores halve the
# run. Every test brings up its own Envoy, kvgate, engines and Redis on free ports, each
# worker from its own part of the port range (tests/conftest.py): the workers share no process.
# `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
test: $(BIN)/kvgate $(NATIVE)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_WORKERS)
	KVGATE_NATIVE=0 $(BIN)/pytest -q -n $(TEST_WORKERS) $(PLAIN_TESTS)

lint: $(BIN)/kvgate
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .hypothesis
