# Two commands a newcomer needs: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/kvgate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

demo: $(BIN)/kvgate
	$(BIN)/kvgate demo

test: $(BIN)/kvgate
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(BIN)/kvgate
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
