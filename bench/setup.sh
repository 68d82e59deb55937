#!/usr/bin/env bash
# Benchmark extras: matplotlib for the charts, and llama.cpp's own tools (llama-bench,
# llama-perplexity, llama-quantize, llama-server) built from the llama-cpp-python 0.3.36 sdist for
# this CPU by bench/llamacpp.sh: the strongest build (clang, native, AMX where the CPU has it) and
# the GCC build beside it. ~20 minutes a build on 2 cores, cached in ~/.cache/qwc.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q matplotlib==3.11.2 2> >(grep -v "is ignored: it is neither" >&2)
bench/llamacpp.sh x86 >/dev/null
bench/llamacpp.sh x86-gcc >/dev/null
