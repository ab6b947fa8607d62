# Everything a fresh machine needs: `make test` and `make bench` build the venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin torch so pip takes the local CPU wheel instead of several GB of CUDA packages;
# on a GPU machine run with TORCH_SPEC="torch" (or the image's own torch).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint bench bench-offline bench-serving-cost gpu-install gpu-smoke gpu-smoke-cpu gpu-check gpu-check-tests \
	gpu-check-kernels gpu-check-graphs-gpt2 gpu-check-graphs-qwen gpu-check-ab gpu-served gpu-check-cpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# pytest-xdist runs the test files on one worker per core (a file's module fixtures, a tritonserver
# say, start once); each worker takes its share of the cores' threads (tests/conftest.py). The Ray
# tests run after, alone: each starts a simulated cluster on this machine. Exit status 5 is pytest's
# "nothing selected" (PYTEST_ARGS naming files without Ray tests).
PYTEST_WORKERS ?= auto
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not ray" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m ray $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The unit and oracle tests: no tritonserver, no Ray cluster, none marked slow (the engine through
# Triton's interpreter, the reruns under other CPU builds); `make test` runs everything.
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not integration and not ray and not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# The main job: serve orca and baseline on a real tritonserver, run the A/B sweep, write the report.
BENCH_ARGS ?=
bench: setup
	$(VENV)/bin/orca-bench --out bench_results $(BENCH_ARGS)

# Offline engine throughput: iteration-level vs request-level on the GPT-2-small preset.
bench-offline: setup
	$(PY) benchmarks/offline.py

# The serving path's CPU per streamed token and per response, the model's cost taken out (the
# constant-time measurement device), for 1, 2 and 4 `orca` instances over one engine core.
SERVING_COST_ARGS ?= --streams 64,256,1024 --instances 1,2,4 --tokens 64 --repeats 3
bench-serving-cost: setup
	$(PY) benchmarks/serving_cost.py $(SERVING_COST_ARGS) --out bench_results/serving-cost.json

# On a GPU machine, with its own python3 (no venv; torch, triton, transformers, pytest and pytest-xdist
# there), the package installed into it without dependencies; results in GPU_OUT.
PYTHON ?= python3
GPU_OUT ?= gpu_results
gpu-install:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .

# The first command on a lent GPU (benchmarks/gpu_smoke.py, its docstring has the budget): versions and
# clocks, the kernel tests never run compiled, CUDA graphs of both models (every bucket captured, replay
# times, traces), decode attention against copy bandwidth, Triton compile seconds, and with the wheels
# of WHEELS carried (see gpu-served) the serving path's CPU per token for 1, 4 and 8 instances. Each
# stage in its own process under its own timeout, its results in GPU_OUT as it ends; under 7 minutes
# on one H100.
GPU_SMOKE_ARGS ?=
gpu-smoke: gpu-install
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then $(PYTHON) -m pip install -q --no-deps $(WHEELS)/*.whl; fi
	$(PYTHON) benchmarks/gpu_smoke.py --out $(GPU_OUT) $(GPU_SMOKE_ARGS)

# The same script on CPU, as CI runs it (tests/benchmarks/test_gpu_smoke.py): every stage with tiny settings.
GPU_SMOKE_CPU_OUT ?= build/gpu_smoke_cpu
gpu-smoke-cpu: setup
	$(PY) benchmarks/gpu_smoke.py --device cpu --quick --out $(GPU_SMOKE_CPU_OUT) $(GPU_SMOKE_ARGS)

# The full check, in parts that each fit one device command (each under 6 minutes on one H100; the
# estimates are from the last recorded runs, docs/development.md): the CUDA tests, then
# benchmarks/gpu_check.py's sections, the graphs section one model at a time. Each part writes its own
# folder under GPU_OUT. `make gpu-check` runs every part, each even if an earlier one failed.
# pytest-xdist, where installed, spreads the tests' Triton compilations over 8 workers, each with 2 CPU
# threads for the transformers oracle (16 threads in each worker oversubscribed an H100 machine's 16
# cores: 198 s for the tests, 36 s with 2).
GPU_CHECK_ARGS ?=
GPU_TESTS = tests/kernels/test_kernels.py tests/kernels/test_kernels_llama.py tests/kernels/test_triton_decode_attention.py \
	tests/kernels/test_norm_linear.py \
	tests/kernels/test_lora_kernels.py tests/kernels/test_triton_window_attention.py \
	tests/kernels/test_triton_fp8_kv_cache.py tests/kernels/test_w8a8_gemm.py \
	tests/model/test_fp8.py tests/model/test_moe.py tests/model/test_cuda.py
GPU_CHECK = $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
GPU_CHECK_PARTS = gpu-check-tests gpu-check-kernels gpu-check-graphs-gpt2 gpu-check-graphs-qwen gpu-check-ab
gpu-check:
	rc=0; for part in $(GPU_CHECK_PARTS); do $(MAKE) --no-print-directory $$part || rc=1; done; exit $$rc
gpu-check-tests: gpu-install
	xdist=$$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 8"); \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PYTHON) -m pytest -q -p no:cacheprovider $$xdist -rfEs --durations=10 $(GPU_TESTS)
gpu-check-kernels: gpu-install
	$(GPU_CHECK) --sections ceilings,kernels,decode,prefill --out $(GPU_OUT)/kernels
gpu-check-graphs-gpt2: gpu-install
	$(GPU_CHECK) --sections graphs --graph-models gpt2-medium --out $(GPU_OUT)/graphs-gpt2
gpu-check-graphs-qwen: gpu-install
	$(GPU_CHECK) --sections graphs --graph-models qwen2.5-0.5b --out $(GPU_OUT)/graphs-qwen
gpu-check-ab: gpu-install
	$(GPU_CHECK) --sections ab --out $(GPU_OUT)/ab

# The served A/B on a GPU machine that has no tritonserver and no network: the two wheels carried
# beside the tree (pip download --no-deps nvidia-pytriton==0.7.0 tritonclient -d wheels; about 55 MB),
# installed without dependencies, then orca-bench against orca and baseline on the GPU, report in
# GPU_SERVED_OUT (docs/bench/gpu/served when it is a run to keep).
WHEELS ?= wheels
GPU_SERVED_OUT ?= gpu_results/served
GPU_SERVED_ARGS ?= --model gpt2-medium --dtype bfloat16
gpu-served:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e . $(WHEELS)/*.whl
	$(PYTHON) -m orca_client.bench --device cuda --out $(GPU_SERVED_OUT) $(GPU_SERVED_ARGS)

# The same script on CPU, as CI runs it (tests/benchmarks/test_gpu_check.py): every section end to end with
# --quick's small settings (gpt2-tiny, float32, the kernels in Triton's interpreter, a short A/B);
# about 10 s. It proves the code paths, not a GPU's figures. Report in GPU_CPU_OUT.
GPU_CPU_OUT ?= build/gpu_check_cpu
gpu-check-cpu: setup
	$(PY) benchmarks/gpu_check.py --device cpu --quick --out $(GPU_CPU_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
