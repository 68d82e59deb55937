"""Qwen3 at the published shapes against transformers (issue 87's exactness), random weights
(the presets, models/presets.py):

    .venv/bin/python bench/qwen3_exactness.py [--presets qwen3-0.6b,qwen3-1.7b,qwen3-8b-2layers,qwen3-32b-2layers]
                                              [--greedy qwen3-0.6b] [--workdir DIR]

For each preset: the streamed export (the route a checkpoint of 1B parameters and more takes)
in onnxruntime against transformers' float logits on the same weights, a prompt of 8 tokens
then 3 decode steps, as the largest difference over the largest logit. With --greedy, the host
artifact with float linears, float activations and cache (the file's Q8_0 embedding, written
to a GGUF with every linear F32, which the export keeps) against transformers' 16 greedy tokens
on that file's weights. Prints a table."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROMPT = np.array([[72, 101, 108, 108, 111, 44, 32, 119]])
STEPS = [np.array([[5]]), np.array([[6]]), np.array([[7]])]


def torch_logits(model, prompt, steps) -> list[np.ndarray]:
    """transformers with its own cache: the prompt, then a token a step."""
    import torch
    from transformers.cache_utils import DynamicCache

    cache, outs, past = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for ids in [prompt] + steps:
            s = ids.shape[1]
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.ones(1, past + s, dtype=torch.int64),
                        position_ids=torch.arange(past, past + s).unsqueeze(0), past_key_values=cache, use_cache=True)
            outs.append(out.logits.numpy())
            past += s
    return outs


def export_error(name: str, work: Path, keep: bool = False) -> tuple[float, float]:
    """(the largest relative difference over the steps, seconds) of the streamed export; the
    graph is deleted after unless `keep`."""
    from qwc.cli import main as qwc
    from qwc.config import sidecar_paths
    from qwc.models.presets import load_preset
    from qwc.passes.verify import run_steps, session

    out = work / f"{name}.onnx"
    t0 = time.perf_counter()
    if not out.exists():
        assert qwc(["-q", "export", name, "-o", str(out), "--exporter", "stream"]) in (0, None)
    lm = load_preset(name)
    want = torch_logits(lm.model, PROMPT, STEPS)
    cfg = lm.config
    del lm
    gc.collect()
    got = run_steps(session(str(out)), cfg, [PROMPT] + STEPS)
    err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))
    if not keep:   # 10 GB of float32 for the 32B cut: one preset's graph on disk at a time
        for f in (out, out.with_name(out.name + ".data"), *sidecar_paths(out)):
            f.unlink(missing_ok=True)
    return err, time.perf_counter() - t0


def greedy(name: str, work: Path, n: int = 16) -> tuple[int, int]:
    """(tokens equal to transformers' greedy ones, n) on the float-linear artifact."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf import TokenType
    from gguf.quants import quantize

    from qwc.cli import main as qwc
    from qwc.models.checkpoint import expected_tensors
    from qwc.models.gguf_loader import load_gguf
    from qwc.models.gguf_writer import Planned, write_gguf
    from qwc.models.presets import preset_checkpoint
    from qwc.runtime.engine import Engine

    gguf, art = work / f"{name}-f32.gguf", work / f"{name}-float.qwc"
    if not gguf.exists():
        ckpt = preset_checkpoint(name)
        cfg = ckpt.config
        tensors = {}
        for t, shape in expected_tensors(cfg).items():
            if t == "model.embed_tokens.weight":
                tensors[t] = Planned((shape[0], shape[1] // 32 * 34), np.dtype(np.uint8), Q.Q8_0,
                                     lambda t=t: quantize(ckpt.tensor(t), Q.Q8_0))
            else:
                tensors[t] = Planned(tuple(shape), np.dtype(np.float32), None, lambda t=t: ckpt.tensor(t))
        vocab = sorted(ckpt.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(vocab))]
        write_gguf(gguf, "qwen3", cfg, tokens, [TokenType.NORMAL] * len(tokens), tensors)
    if not art.exists():
        assert qwc(["-q", "export", str(gguf), "-o", str(work / f"{name}-f32.onnx")]) in (0, None)
        assert qwc(["-q", "optimize", str(work / f"{name}-f32.onnx"), "-o", str(work / f"{name}-float.onnx"),
                    "--keep-float", "*", "--lm-head-bits", "8"]) in (0, None)
        assert qwc(["-q", "compile", str(work / f"{name}-float.onnx"), "-o", str(art), "--act-bits", "32",
                    "--kv-dtype", "f32"]) in (0, None)
    model = load_gguf(gguf).model
    want = PROMPT[0].tolist()
    with torch.no_grad():
        for _ in range(n):
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    del model
    gc.collect()
    eng = Engine(art, ctx=64)
    logits, got = eng.prefill(PROMPT[0].tolist()), []
    for _ in range(n):
        got.append(int(logits.argmax()))
        logits = eng.decode(got[-1])
    return sum(a == b for a, b in zip(got, want[PROMPT.shape[1]:])), n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen3-0.6b,qwen3-1.7b,qwen3-8b-2layers,qwen3-32b-2layers")
    p.add_argument("--greedy", default="", help="presets whose float-linear artifact's greedy tokens are checked")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "qwen3")
    p.add_argument("--keep", action="store_true", help="keep the exported graphs")
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [x for x in a.presets.split(",") if x]:
        err, secs = export_error(name, a.workdir, a.keep)
        print(f"  {name}: export {err:.2e} ({secs:.0f} s)", file=sys.stderr, flush=True)
        rows.append((name, err, greedy(name, a.workdir) if name in a.greedy.split(",") else None))
    print("\n| preset | onnxruntime vs transformers (max diff / max logit) | greedy tokens = transformers' |")
    print("| --- | ---: | ---: |")
    for name, err, g in rows:
        print(f"| {name} | {err:.1e} | {'-' if g is None else f'{g[0]} / {g[1]}'} |")


if __name__ == "__main__":
    main()
