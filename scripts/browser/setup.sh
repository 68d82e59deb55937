#!/usr/bin/env bash
# Install Debian's Chromium for the chat page's browser test (tests/serve/test_chat_page.py),
# which runs it headless through its DevTools protocol. Idempotent; needs root and apt.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
echo "[qwc browser] installing Debian's chromium package" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
chromium --version >&2
