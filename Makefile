# Everything a fresh machine needs: `make test` and `make bench` build the venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin torch so pip takes the local CPU wheel instead of several GB of CUDA packages;
# on a GPU machine run with TORCH_SPEC="torch" (or the image's own torch).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test lint bench bench-offline clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# The main job: serve orca and baseline on a real tritonserver, run the A/B sweep, write the report.
BENCH_ARGS ?=
bench: setup
	$(VENV)/bin/orca-bench --out bench_results $(BENCH_ARGS)

# Offline engine throughput: iteration-level vs request-level on the GPT-2-small preset.
bench-offline: setup
	$(PY) benchmarks/offline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
