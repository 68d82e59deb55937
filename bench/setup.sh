#!/usr/bin/env bash
# Benchmark extras: matplotlib for the chart, and llama.cpp (llama-cpp-python) built from its
# PyPI sdist for this CPU. The native build takes ~20 minutes on 2 cores, so the wheel is cached
# outside the repo (~/.cache/qwc/wheels) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${XDG_CACHE_HOME:-$HOME/.cache}/qwc/wheels
mkdir -p "$WHEELS"
.venv/bin/python -m pip install -q matplotlib==3.11.2 2> >(grep -v "is ignored: it is neither" >&2)
if ! ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  echo "[bench setup] building llama-cpp-python 0.3.36 (about 20 minutes)" >&2
  # AMX off: llama.cpp's AMX matmul segfaults on this machine's (virtualised) AMX; its AVX-512
  # and Q4_0 repack paths stay on, as a user of this CPU would run it.
  CMAKE_ARGS="-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF" \
    .venv/bin/python -m pip wheel --no-deps --no-cache-dir -w "$WHEELS" llama-cpp-python==0.3.36
fi
.venv/bin/python -m pip install -q --no-deps "$WHEELS"/llama_cpp_python-0.3.36-*.whl diskcache==5.6.3 \
  2> >(grep -v "is ignored: it is neither" >&2)
