#!/usr/bin/env bash
# Create .venv and install qwc with its pinned dependencies and test tools (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: qwc needs Python >= 3.11 ($PY is $("$PY" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# --progress-bar off: CI logs stay readable. pip's extra local indexes warn about
# folders they lack; that noise is filtered, real errors still fail the script.
# On aarch64 PyPI's torch 2.13.0 is the CUDA build (nvidia-* wheels and triton, ~3.5 GB) that an
# ARM server has no use for: everything but the torch extra (pyproject.toml) is installed.
arch=$(uname -m)
if [ "$arch" = aarch64 ] || [ "$arch" = arm64 ]; then
    extras="compile,serve,ray,bench,test"
    echo "setup: $arch: installing qwc without the torch extra (presets, qwc qat / lora, --awq / --gptq," \
         "PEFT adapters need it: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu," \
         "then .venv/bin/pip install -e '.[torch]')"
else
    extras="dev"
fi
.venv/bin/python -m pip install --progress-bar off -q -e ".[$extras]" 2> >(grep -v "is ignored: it is neither" >&2)
echo "setup: installed qwc[$extras] for $arch"
.venv/bin/qwc --version
