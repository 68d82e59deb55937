"""Real K-quant files, run as they are: SmolLM2-135M-Instruct (`qwc data fetch`) requantized by
llama.cpp's llama-quantize (bench/llamacpp.sh x86) to each mix, exported and compiled by qwc for
the host, then llama-server's greedy continuation of a prompt against qwc fed llama-server's
tokens, step by step:

    .venv/bin/python bench/kquant_files.py [--mixes Q4_K_M,Q5_K_M,Q4_K_S,Q6_K] [--tokens 16]
        [--target host|arm-yitian|arm-neon] [--gguf FILE] [--llama-against "-fa off"]

An ARM target's artifact is cross-compiled and fed the same steps under qemu
(scripts/arm64/setup.sh), one emulated engine run a file. `--gguf FILE` takes that file as it
is instead of SmolLM2's mixes (e.g. bench/formats.py's llama-quantize Q4_K_M of a random
1.5B: its merges are dropped for qwc's export, formats.without_merges). Both engines are given
the prompt as the export's tokenizer encodes it, as token ids.

The table has each file's tensor types (SmolLM2's rows of 576 make most of them the fallbacks
Q5_0 / Q5_1 / Q8_0), llama.cpp's text, how many of llama.cpp's tokens qwc picks too, and where
it does not, the largest gap between qwc's top logit and llama.cpp's token (near ties of the two
engines' Q8_0 activations; the README demo's test allows 0.1). The last two columns hold
llama-server to itself the same way: run with `--llama-against`'s options (flash attention off
by default), fed its default run's tokens one at a time, how many it picks again and its
largest gap where not. A miss of qwc's inside that scale is a tie llama.cpp's own arithmetic
does not decide.
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


def _server(server: Path, gguf: Path, extra: tuple[str, ...] = ()):
    """llama-server on `gguf` (2 threads, 256 positions, `extra` options), once it answers."""
    srv = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(PORT), "-t", "2", "-c", "256", *extra],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    return srv


def _complete(body: dict) -> dict:
    return json.load(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{PORT}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})))


def server_tokens(server: Path, gguf: Path, prompt: list[int], n: int) -> tuple[str, list[int]]:
    """llama-server's greedy text and tokens after the prompt's ids (temperature 0, up to n,
    its end of text ends it)."""
    srv = _server(server, gguf)
    try:
        r = _complete({"prompt": prompt, "temperature": 0, "n_predict": n, "return_tokens": True})
    finally:
        srv.terminate()
        srv.wait()
    return r["content"], r["tokens"]


def server_follows(server: Path, gguf: Path, prompt: list[int], tokens: list[int],
                   extra: tuple[str, ...]) -> tuple[int, float]:
    """llama-server with `extra` options against its own default run, as `follow` holds qwc:
    (its picks equal to `tokens`, the largest gap between its top log-probability and the
    token's where they differ), fed the tokens in turn. Each request extends the last, so its
    cached prompt is reused and each step evaluates one new token, as the default run decoded
    it. How far llama.cpp's own arithmetic moves a near tie (flash attention on or off) is the
    scale against which qwc's misses are read."""
    srv = _server(server, gguf, extra)
    agree, gap = 0, 0.0
    try:
        for i, t in enumerate(tokens):
            probs = _complete({"prompt": prompt + tokens[:i], "temperature": 0, "n_predict": 1, "n_probs": 40,
                               "cache_prompt": True})["completion_probabilities"][0]["top_logprobs"]
            top, lp = probs[0], {x["id"]: x["logprob"] for x in probs}
            agree += top["id"] == t
            if top["id"] != t:   # a token outside its top 40 counts as the 40th's gap
                gap = max(gap, top["logprob"] - lp.get(t, probs[-1]["logprob"]))
    finally:
        srv.terminate()
        srv.wait()
    return agree, gap


def prompt_ids(onnx_: Path, prompt: str) -> list[int]:
    """The prompt as the export's tokenizer (its sidecar) encodes it."""
    from tokenizers import Tokenizer

    from qwc.config import sidecar_paths

    return Tokenizer.from_file(str(sidecar_paths(onnx_)[1])).encode(prompt, add_special_tokens=False).ids


def follow(art: Path, ids: list[int], tokens: list[int], target: str = "host") -> tuple[int, float]:
    """(qwc's picks equal to llama.cpp's tokens, the largest logit gap where they differ): the
    prompt ids, then each of llama.cpp's tokens fed in turn; on an ARM target under qemu."""
    import numpy as np

    if target == "host":
        from qwc.runtime.engine import Engine

        eng = Engine(art, ctx=64)
        rows = [eng.prefill(ids)] + [eng.decode(t) for t in tokens[:-1]]
    else:
        from qwc.bench import emulation

        env, out = emulation.arm64_env(), art.with_suffix(".steps.npy")
        r = subprocess.run(emulation.engine_command(env, art, out, json.dumps([ids] + tokens[:-1])), env=env,
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"kquant_files: the emulated engine failed: {r.stderr[-2000:]}")
        rows = list(np.load(out))
    agree = sum(int(row.argmax()) == t for row, t in zip(rows, tokens))
    gap = max(float(row.max() - row[t]) for row, t in zip(rows, tokens))
    return agree, gap


def _files(args, tools) -> list[tuple[str, Path, Path]]:
    """(name, the file llama-server reads, the file qwc exports) of each row."""
    from qwc.bench.accuracy import llamacpp_quantized
    from qwc.eval.data import smollm2_path

    if args.gguf:
        from qwc.bench.formats import without_merges

        return [(args.gguf.name, args.gguf, without_merges(args.gguf, args.workdir / f"{args.gguf.stem}-qwc.gguf"))]
    out = []
    for mix in args.mixes.split(","):
        gguf = llamacpp_quantized(tools, smollm2_path(), args.workdir / f"smollm2-{mix}.gguf", kind=mix)
        out.append((mix, gguf, gguf))
    return out


def main() -> None:
    from gguf import GGUFReader

    from qwc.bench.llamacpp import tools as llamacpp_tools
    from qwc.cli import main as qwc

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", default="Q4_K_M,Q5_K_M,Q4_K_S,Q6_K")
    p.add_argument("--gguf", type=Path, help="this file as it is, instead of SmolLM2's mixes")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "kquant_files")
    p.add_argument("--target", default="host", choices=("host", "arm-yitian", "arm-neon"),
                   help="the artifact's target (ARM: run under qemu)")
    p.add_argument("--llama-against", default="-fa off",
                   help="llama-server options whose run is held to its default run as qwc is (a column "
                        "of its own; '' for none)")
    args = p.parse_args()
    if args.gguf and not args.gguf.is_file():
        raise SystemExit(f"kquant_files: no file {args.gguf}")
    tools = llamacpp_tools("x86")
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"qwc on {args.target}\n")
    against = tuple(args.llama_against.split())
    column = f" llama.cpp `{args.llama_against}` picks its own token | its largest gap |" if against else ""
    print(f"| file | its types | llama.cpp's text | qwc picks llama.cpp's token | largest gap where not |{column}")
    print("| --- | --- | --- | ---: | ---: |" + (" ---: | ---: |" if against else ""))
    for name, gguf, ours in _files(args, tools):
        stem = args.workdir / ours.stem
        onnx_, art = Path(f"{stem}.onnx"), Path(f"{stem}-{args.target}.qwc")   # (stems with dots: 2.5)
        if not onnx_.exists():
            assert qwc(["-q", "export", str(ours), "-o", str(onnx_)]) in (0, None)
        if not art.exists():
            assert qwc(["-q", "compile", str(onnx_), "-o", str(art), "--target", args.target]) in (0, None)
        types = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors if t.name.startswith("blk."))
        types = ", ".join(f"{c} {k}" for k, c in types.most_common() if k != "F32")
        ids = prompt_ids(onnx_, args.prompt)
        text, tokens = server_tokens(tools / f"llama-server-{VERSION}", gguf, ids, args.tokens)
        agree, gap = follow(art, ids, tokens, args.target)
        row = f"| {name} | {types} | {json.dumps(text)} | {agree} / {len(tokens)} | {_gap(agree, gap, tokens)} |"
        if against:
            own, own_gap = server_follows(tools / f"llama-server-{VERSION}", gguf, ids, tokens, against)
            row += f" {own} / {len(tokens)} | {_gap(own, own_gap, tokens)} |"
        print(row, flush=True)


def _gap(agree: int, gap: float, tokens: list[int]) -> str:
    return f"{gap:.3f}" if agree < len(tokens) else "-"


if __name__ == "__main__":
    main()
