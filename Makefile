# Two entry points (see README): `make demo` runs the main job, `make test` runs the checks.
# Both create .venv with everything they need on a fresh Linux or macOS machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint install

$(BIN)/kvsnap: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(BIN)/kvsnap

install: $(BIN)/kvsnap

demo: install
	$(BIN)/python examples/demo.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest tests
