#!/usr/bin/env bash
# Benchmark extras: matplotlib for the charts, and llama.cpp's own tools (llama-bench,
# llama-perplexity, llama-quantize, llama-server) built from the llama-cpp-python sdist (bench/llamacpp.py: VERSION) for
# this CPU by bench/llamacpp.sh: the strongest build (clang, native, AMX where the CPU has it) and
# the GCC build beside it. ~20 minutes a build on 2 cores, cached in ~/.cache/qwc. Debian's
# llvm-19 for llvm-mca's Neoverse-N2 model (bench/arm_icount.py --mca, bench/arm_threads.py), and
# linux-perf for bench/decode_profile.py.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q -e '.[bench]' 2> >(grep -v "is ignored: it is neither" >&2)   # matplotlib, pinned in pyproject.toml
if [[ ! -x /usr/lib/llvm-19/bin/llvm-mca ]]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends llvm-19 >/dev/null
fi
if ! command -v perf >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf >/dev/null
fi
bench/llamacpp.sh x86 >/dev/null
bench/llamacpp.sh x86-gcc >/dev/null
