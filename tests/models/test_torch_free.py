"""The route from a GGUF to answers (the README's first command: export, compile, run), `qwc
optimize` and `qwc serve` import no torch, so an install without the torch extra (an ARM server's:
scripts/setup.sh on aarch64) runs them; a command that needs torch there says so in one line.
`qwc run`, `bench` and `serve` need not even the compiler (`qwc[runtime]`: no onnx, onnxruntime,
transformers or gguf), for artifacts compiled elsewhere."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_gguf_formats import FORMATS, write_model

TORCH_EXTRA = ("torch", "peft", "accelerate", "onnxscript")
COMPILE_EXTRA = ("onnx", "onnx_ir", "onnxruntime", "transformers", "gguf", "safetensors", "cloudpickle", "psutil",
                 "tornado")

# Runs in a fresh interpreter with the torch extra's modules made unimportable, as on an
# install without it (TVM's FFI and transformers import torch only where they find it).
_NO_TORCH = f"""
import sys
for name in {TORCH_EXTRA!r}:
    sys.modules[name] = None
from qwc.cli import main
"""
# ... and the compile extra's too: the runtime-only install (`pip install 'qwc[runtime]'`).
_RUNTIME_ONLY = _NO_TORCH.replace("for name in", f"for name in {COMPILE_EXTRA!r} +")
_ROUTE = _NO_TORCH + """
src, d = sys.argv[1], sys.argv[2]
for argv in (["export", src, "-o", d + "/m.onnx"], ["optimize", d + "/m.onnx", "-o", d + "/q.onnx"],
             ["compile", d + "/q.onnx", "-o", d + "/m.qwc"]):
    code = main(["-q", *argv])
    if code:
        sys.exit(f"qwc {argv[0]} exited {code}")
"""
_RUN = _RUNTIME_ONLY + """
art = sys.argv[1]
for argv in (["run", art, "--prompt", "Hi", "--max-new-tokens", "2", "--ctx", "64"],
             ["bench", art, "-p", "8", "-n", "2", "-r", "1", "--ctx", "64"]):
    code = main(["-q", *argv])
    if code:
        sys.exit(f"qwc {argv[0]} exited {code}")
assert not {"onnx", "onnxruntime", "transformers", "gguf"} & {m.split(".")[0] for m in sys.modules if sys.modules[m]}
"""


@pytest.mark.slow
def test_gguf_export_optimize_compile_run_serve_need_no_torch(tmp_path):
    write_model(tmp_path / "m.gguf", FORMATS)
    r = subprocess.run([sys.executable, "-c", _ROUTE, str(tmp_path / "m.gguf"), str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "m.qwc" / "manifest.json").is_file()
    r = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "m.qwc")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("Hi") and any("pp8" in line for line in out) and any("tg2" in line for line in out)
    _serves_runtime_only(tmp_path / "m.qwc")


def _serves_runtime_only(art) -> None:
    """`qwc serve` on the artifact, torch and the compiler unimportable, answers a completion
    with a JSON schema."""
    import socket
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = _RUNTIME_ONLY + f"sys.exit(main(['-q', 'serve', {str(art)!r}, '--port', '{port}', '--ctx', '64']))"
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


def test_a_command_that_needs_the_compiler_names_the_extra(tmp_path):
    """The runtime-only install: `qwc compile` says in one line which extra it needs."""
    (tmp_path / "m.onnx").write_bytes(b"")
    code = _RUNTIME_ONLY + f"sys.exit(main(['-q', 'compile', {str(tmp_path / 'm.onnx')!r}, '-o', {str(tmp_path / 'm.qwc')!r}]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("qwc: error: qwc compile needs ") and err[0].endswith("pip install 'qwc[compile]'")
    assert not (tmp_path / "m.qwc").exists()


def test_the_runtime_install_holds_neither_the_compiler_nor_torch():
    """pyproject.toml: `qwc[runtime]` is the dependencies proper plus the server's, and every
    module the tests above make unimportable belongs to the compile or torch extra."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs):
        return {r.split("==")[0].split("[")[0].strip().lower().replace("-", "_") for r in reqs}

    assert extras["runtime"] == ["qwc[serve]"]
    runtime = names(project["dependencies"]) | names(extras["serve"])
    assert not runtime & {"torch", "onnx", "onnxruntime", "onnx_ir", "transformers", "gguf", "safetensors", "peft"}
    assert names(extras["compile"]) >= {"onnx", "onnx_ir", "onnxruntime", "transformers", "gguf", "safetensors"}
    assert names(extras["torch"]) >= {"torch", "onnxscript", "peft", "accelerate"}
