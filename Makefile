# interlace developer commands. `make demo` and `make test` work from a fresh clone:
# each creates .venv (Python 3.11) and installs what it needs, torch first (the CPU build
# pinned below; a bare `torch` requirement resolved first would pull a multi-GB CUDA build),
# and the extras whose tests would otherwise skip (ray: executor="ray", pandas: to_pandas(),
# eval: docs/edit.md's lm-evaluation-harness example; tests run with HF_DATASETS_OFFLINE=1).

PYTHON311 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.11.*/bin/python3.11) $(shell command -v python3.11))
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.interlace-installed
# The torch-free tracer core is also tested on these interpreters (skipped, with a line, when absent).
CORE_VERSIONS ?= 3.10 3.12 3.13

.PHONY: demo check test test-native test-twin test-greenlets test-core-versions build bench clean

$(STAMP): pyproject.toml setup.py
	test -x "$(PY)" || "$(PYTHON311)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "setuptools>=77" "Cython>=3.0" wheel
	$(PY) -m pip install -q --no-build-isolation -e ".[test,demo,compare,ray,pandas,datasets,eval]"
	touch $(STAMP)

build: $(STAMP)
	INTERLACE_REQUIRE_EXTENSIONS=1 $(PY) setup.py -q build_ext --inplace

demo: $(STAMP) build
	$(PY) -m demo

# The developer loop: ruff (rules in pyproject.toml) and the tests not marked `slow`
# (subprocesses, fuzzing, the benchmark smoke run, Ray), compiled path only.
check: build
	$(PY) -m ruff check .
	INTERLACE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The whole suite, once on the compiled extension (which must load) and once on the twin.
test: test-native test-twin

test-native: build
	HF_DATASETS_OFFLINE=1 INTERLACE_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-twin: build
	HF_DATASETS_OFFLINE=1 INTERLACE_NO_EXTENSIONS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# The engine's suites once more with generator bodies forced off (INTERLACE_GENERATORS=0:
# every body on a greenlet; intervention/routes.py), compiled path: both routes must give
# the same results.
test-greenlets: build
	HF_DATASETS_OFFLINE=1 INTERLACE_REQUIRE_EXTENSIONS=1 INTERLACE_GENERATORS=0 $(PY) -m pytest -q tests/intervention tests/models tests/sweeps $(PYTEST_ARGS)

# The torch-free tracer core on every other supported interpreter, both paths.
test-core-versions:
	@set -e; for v in $(CORE_VERSIONS); do \
	  py=$$(ls -d $(HOME)/.pyenv/versions/$$v.*/bin/python$$v 2>/dev/null | tail -n 1); \
	  [ -n "$$py" ] || py=$$(command -v python$$v || true); \
	  if [ -z "$$py" ]; then echo "SKIPPED: Python $$v not found on this machine"; continue; fi; \
	  venv=.venv$$(echo $$v | tr -d .); \
	  test -x $$venv/bin/python || $$py -m venv $$venv; \
	  $$venv/bin/python -m pip install -q --upgrade pip; \
	  $$venv/bin/python -m pip install -q "setuptools>=77" "Cython>=3.0" wheel bytecode pytest coverage; \
	  $$venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .; \
	  INTERLACE_REQUIRE_EXTENSIONS=1 $$venv/bin/python setup.py -q build_ext --inplace; \
	  echo "== Python $$v, native"; \
	  INTERLACE_REQUIRE_EXTENSIONS=1 $$venv/bin/python -m pytest -q tests/tracing $(PYTEST_ARGS); \
	  echo "== Python $$v, pure-Python twin"; \
	  INTERLACE_NO_EXTENSIONS=1 $$venv/bin/python -m pytest -q tests/tracing $(PYTEST_ARGS); \
	done

# Every workload and contender in one run: a markdown report on stdout, figures in
# build/bench-cpu.json (benchmarks/README.md). nnsight 0.8.1 and TransformerLens are measured
# when installed (`$(PY) -m pip install -e ".[bench]"`), else skipped with a line saying so.
# BENCH_ARGS, e.g. "--device cuda" or "--repeats 300 --shapes tiny"; "--baseline REF" also measures
# interlace as it was at git ref REF (exported and built under build/baseline-<sha>), in the same
# rounds: every table gets its column and a before -> after line; "--runs 3" reports the median of
# three whole runs (fresh worker processes each) with their spread.
bench: build
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf build src/interlace/*.so csrc/_cframes.c csrc/_chotpath.c
