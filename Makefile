# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint bench gpu-wheels clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned explicitly first: an open range would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera train examples/demo.yaml --nproc 2 --overwrite

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check tessera tests benchmarks

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/zero_vs_peers.py --json docs/zero_vs_peers.json

# benchmarks/gpu_check.py's torchtitan columns on a GPU machine without network: carry .gpu_wheels there and
# `pip install --no-deps --no-index .gpu_wheels/*.whl` (a CUDA build of torch brings triton).
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps -d .gpu_wheels torchtitan==0.3.0 tyro==1.0.17 docstring-parser \
		typeguard spmd_types==0.2.3 einops torchdata torch_checkpointing 'torchao>=0.18,<0.19'

clean:
	rm -rf $(VENV) .pytest_cache
