"""The route from a GGUF to answers (the README's first command: export, compile, run), `qwc
optimize` and `qwc serve` import no torch, so an install without the torch extra (an ARM server's:
scripts/setup.sh on aarch64) runs them; a command that needs torch there says so in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_gguf_formats import FORMATS, write_model

# Runs in a fresh interpreter with the torch extra's modules made unimportable, as on an
# install without it (TVM's FFI and transformers import torch only where they find it).
_NO_TORCH = """
import sys
for name in ("torch", "peft", "accelerate", "onnxscript"):
    sys.modules[name] = None
from qwc.cli import main
"""
_ROUTE = _NO_TORCH + """
src, d = sys.argv[1], sys.argv[2]
for argv in (["export", src, "-o", d + "/m.onnx"], ["optimize", d + "/m.onnx", "-o", d + "/q.onnx"],
             ["compile", d + "/q.onnx", "-o", d + "/m.qwc"],
             ["run", d + "/m.qwc", "--prompt", "Hi", "--max-new-tokens", "2", "--ctx", "64"]):
    code = main(["-q", *argv])
    if code:
        sys.exit(f"qwc {argv[0]} exited {code}")
"""


@pytest.mark.slow
def test_gguf_export_optimize_compile_run_serve_need_no_torch(tmp_path):
    write_model(tmp_path / "m.gguf", FORMATS)
    r = subprocess.run([sys.executable, "-c", _ROUTE, str(tmp_path / "m.gguf"), str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "m.qwc" / "manifest.json").is_file() and r.stdout.splitlines()[-1].startswith("Hi")
    _serves_without_torch(tmp_path / "m.qwc")


def _serves_without_torch(art) -> None:
    """`qwc serve` on the artifact, torch unimportable, answers a completion with a JSON schema."""
    import socket
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = _NO_TORCH + f"sys.exit(main(['-q', 'serve', {str(art)!r}, '--port', '{port}', '--ctx', '64']))"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the server did not come up in 5 minutes"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "m", "prompt": "Hello", "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1 and r.json()["choices"][0]["text"].startswith("{")
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_a_command_that_needs_torch_names_the_extra(tmp_path):
    """torch made unimportable, as on an install without the extra: a preset is built in torch."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from qwc.cli import main\n"
            f"sys.exit(main(['-q', 'export', 'tiny', '-o', {str(tmp_path / 't.onnx')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert err[0] == "qwc: error: qwc export needs torch, which this install lacks: pip install 'qwc[torch]'"
    assert not (tmp_path / "t.onnx").exists()
