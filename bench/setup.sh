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
  # llama.cpp's AMX matmul segfaults on this machine's (virtualised) AMX, and a native build
  # (-march=native) compiles it in whatever GGML_AMX_* says: build for the ISA explicitly, with
  # AVX-512 / VNNI / BF16 and the Q4_0 repack paths on and AMX off.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF" \
    .venv/bin/python -m pip wheel --no-deps --no-cache-dir -w "$WHEELS" llama-cpp-python==0.3.36
fi
.venv/bin/python -m pip install -q --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-0.3.36-*.whl diskcache==5.6.3 \
  2> >(grep -v "is ignored: it is neither" >&2)
