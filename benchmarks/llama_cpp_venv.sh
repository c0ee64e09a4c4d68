#!/usr/bin/env bash
# Creates llama.cpp's own virtual environment (llama-cpp-python, built from its sdist for this
# CPU: GGML_NATIVE, so AVX2 or AVX-512 as the machine has), never a dependency of the project.
# Usage: benchmarks/llama_cpp_venv.sh [VENV_DIR]   (default: benchmarks/.llama-cpp-venv)
# Idempotent: an existing venv whose `import llama_cpp` works is left alone. Building takes
# several minutes on two cores.
set -euo pipefail
VENV=${1:-"$(dirname "$0")/.llama-cpp-venv"}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "$VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_CURL=OFF}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install -q "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" >&2
"$VENV/bin/python" -c "import llama_cpp" >&2
echo "$VENV"
