# The two commands: `make demo` and `make test`. Both do the whole set-up first:
# a virtual environment in .venv (the package installed editable), the pinned llama.cpp
# fetched into vendor/ (download cached in ~/.cache/pyllama-kv), our patches applied, and
# the patched and vanilla CPU builds; then the second pin, the current llama.cpp, fetched into
# vendor/llama.cpp-current with its own series (patches/current/) and built as build/current-cpu.
# Every step is skipped when already done. `make test` runs
# `make lint` (ruff and mypy) before pytest.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all setup venv vendor patch build vendor-current build-current demo lint test sdist wheel clean distclean FORCE

all: test

LCP    := $(VENV)/.llama-cpp-python

# editable, with no library compiled into it (-DPYLLAMA_KV_BUILD=OFF): here the harness builds
# (build/patched-cpu, build/vanilla-cpu); `pip install .` without that flag compiles one into the package
# the editable install knows the package's files by name: a module added, moved or removed reinstalls it
# ($(MODULES) is rewritten only when that list changes)
MODULES := $(VENV)/.modules
$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find pyllama_kv -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@; rm -f $@.new

$(STAMP): pyproject.toml CMakeLists.txt $(MODULES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		--config-settings=cmake.define.PYLLAMA_KV_BUILD=OFF -e '.[test,map,server,events,replicas]'
	@touch $@

venv: $(STAMP)

vendor: $(STAMP)
	$(BIN)/pyllama-kv vendor

# llama-cpp-python 0.3.9 from the same cached sdist, compiling nothing (-DLLAMA_BUILD=OFF):
# it runs on our patched library through LLAMA_CPP_LIB_PATH (tests/test_llama_cpp_python.py)
$(LCP): | vendor
	CMAKE_ARGS="-DLLAMA_BUILD=OFF" $(BIN)/python -m pip install --quiet --disable-pip-version-check \
		"$$($(BIN)/python -c 'from pyllama_kv.harness import vendor as v; print(v.cached_archive(v.Pin.load()))')"
	@touch $@

patch: vendor
	$(BIN)/pyllama-kv patch

build: patch
	$(BIN)/pyllama-kv build --tools --rpc
	$(BIN)/pyllama-kv build --vanilla

# the current llama.cpp (vendor/current.pin.json): its tree, its series (which may be empty), its CPU library
vendor-current: $(STAMP)
	$(BIN)/pyllama-kv vendor --pin current
	$(BIN)/pyllama-kv patch --pin current

build-current: vendor-current
	$(BIN)/pyllama-kv build --pin current

setup: build build-current $(LCP)
	$(BIN)/pyllama-kv pull smollm2-135m-instruct
	$(BIN)/pyllama-kv pull gemma3-270m

demo: setup
	$(BIN)/pyllama-kv demo

# ruff (lint and import order) and mypy, configured in pyproject.toml; both come with the `test`
# extra that the venv step installs (it reruns whenever pyproject.toml changes)
lint: $(STAMP)
	$(BIN)/ruff check pyllama_kv scripts tests
	$(BIN)/mypy

# the package's and the scripts' bytecode first: where PYTHONDONTWRITEBYTECODE is set (this machine kind),
# every server, worker and CLI the suite starts compiled them from source again (0.4 s of the 1.0 s a
# server's imports took)
test: setup lint
	$(BIN)/python -m compileall -q pyllama_kv scripts >/dev/null
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the package: an sdist that carries the patched llama.cpp tree (vendored and patched first), and a
# wheel with the patched library compiled in (CMAKE_ARGS passes backend flags through, e.g.
# CMAKE_ARGS="-DGGML_CUDA=on"); both land in dist/
sdist: patch
	$(BIN)/python -m build --sdist --outdir dist

wheel: patch
	$(BIN)/python -m build --wheel --outdir dist

clean:
	rm -rf build dist

distclean: clean
	rm -rf $(VENV) vendor/llama.cpp vendor/llama.cpp-current
