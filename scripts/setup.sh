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
.venv/bin/python -m pip install --progress-bar off -q -e '.[dev]' 2> >(grep -v "is ignored: it is neither" >&2)
.venv/bin/qwc --version
