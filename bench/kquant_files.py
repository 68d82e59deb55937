"""Real K-quant files, run as they are: SmolLM2-135M-Instruct (`qwc data fetch`) requantized by
llama.cpp's llama-quantize (bench/llamacpp.sh x86) to each mix, exported and compiled by qwc for
the host, then llama-server's greedy continuation of a prompt against qwc fed llama-server's
tokens, step by step:

    .venv/bin/python bench/kquant_files.py [--mixes Q4_K_M,Q5_K_M,Q4_K_S,Q6_K] [--tokens 16]

The table has each file's tensor types (SmolLM2's rows of 576 make most of them the fallbacks
Q5_0 / Q5_1 / Q8_0), llama.cpp's text, how many of llama.cpp's tokens qwc picks too, and where
it does not, the largest gap between qwc's top logit and llama.cpp's token (near ties of the two
engines' Q8_0 activations; the README demo's test allows 0.1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

from qwc.bench.llamacpp import VERSION

HERE = Path(__file__).resolve().parent
PORT = 8937


def server_tokens(server: Path, gguf: Path, prompt: str, n: int) -> tuple[str, list[int]]:
    """llama-server's greedy text and tokens (temperature 0, up to n, its end of text ends it)."""
    srv = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(PORT), "-t", "2", "-c", "256"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        req = json.dumps({"prompt": prompt, "temperature": 0, "n_predict": n, "return_tokens": True}).encode()
        r = json.load(urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{PORT}/completion", req, {"Content-Type": "application/json"})))
    finally:
        srv.terminate()
        srv.wait()
    return r["content"], r["tokens"]


def follow(art: Path, onnx_: Path, prompt: str, tokens: list[int]) -> tuple[int, float]:
    """(qwc's picks equal to llama.cpp's tokens, the largest logit gap where they differ)."""
    from tokenizers import Tokenizer

    from qwc.config import sidecar_paths
    from qwc.runtime.engine import Engine

    ids = Tokenizer.from_file(str(sidecar_paths(onnx_)[1])).encode(prompt, add_special_tokens=False).ids
    eng = Engine(art, ctx=64)
    logits, agree, gap = eng.prefill(ids), 0, 0.0
    for t in tokens:
        agree += int(logits.argmax()) == t
        gap = max(gap, float(logits.max() - logits[t]))
        logits = eng.decode(t)
    return agree, gap


def main() -> None:
    from gguf import GGUFReader

    from qwc.bench.accuracy import llamacpp_quantized
    from qwc.bench.llamacpp import tools as llamacpp_tools
    from qwc.cli import main as qwc
    from qwc.eval.data import smollm2_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", default="Q4_K_M,Q5_K_M,Q4_K_S,Q6_K")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "kquant_files")
    args = p.parse_args()
    tools = llamacpp_tools("x86")
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("| file | its types | llama.cpp's text | qwc picks llama.cpp's token | largest gap where not |")
    print("| --- | --- | --- | ---: | ---: |")
    for mix in args.mixes.split(","):
        gguf = llamacpp_quantized(tools, smollm2_path(), args.workdir / f"smollm2-{mix}.gguf", kind=mix)
        onnx_, art = args.workdir / f"smollm2-{mix}.onnx", args.workdir / f"smollm2-{mix}.qwc"
        if not art.exists():
            assert qwc(["-q", "export", str(gguf), "-o", str(onnx_)]) in (0, None)
            assert qwc(["-q", "compile", str(onnx_), "-o", str(art)]) in (0, None)
        types = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors if t.name.startswith("blk."))
        types = ", ".join(f"{c} {k}" for k, c in types.most_common() if k != "F32")
        text, tokens = server_tokens(tools / f"llama-server-{VERSION}", gguf, args.prompt, args.tokens)
        agree, gap = follow(art, onnx_, args.prompt, tokens)
        print(f"| {mix} | {types} | {json.dumps(text)} | {agree} / {len(tokens)} | "
              f"{f'{gap:.3f}' if agree < len(tokens) else '-'} |", flush=True)


if __name__ == "__main__":
    main()
