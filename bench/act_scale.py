"""Per-row against per-block int8 activations (issue 68's `--act-scale`), measured before any
kernel: SmolLM2 in torch with qwc's PTQ weights (Q4_0 linears, Q8_0 embedding / tied lm_head,
fake-quantized), and each linear's input quantized as the compiled W4A8 graph would:

  block     Q8_0: a scale per 32 inputs (what qwc's kernels and llama.cpp's do today)
  row       int8 with one scale per row (token), symmetric
  row-asym  int8 with one scale and a zero point per row (KleidiAI's qai8dx, the activations of
            its matmul_clamp_f32_qai8dxp_qsi4c32p kernels)

    .venv/bin/python bench/act_scale.py [--chunks 40] [--calib-windows 4] [--threads 2]
                                        [--auto row:0.01,row-asym:0.02] [--graph G.onnx]

Prints two tables:
1. per linear kind (q/k/v share an input, gate/up share one) and layer: the relative error of the
   linear's output, ||W q(x) - W x|| / ||W x||, on calibration text (Emma, windows of 512), for
   each format: what `auto` decides on;
2. perplexity on Pride and Prejudice (ctx 512, `--chunks` chunks, bench/accuracy.py's protocol)
   with every linear's input in each format, and with each `--auto` MODE:T: MODE's rows where
   a linear's error in them exceeds its block error by at most T (absolute, in relative-error
   units), blocks elsewhere.
A simulation in float (torch), labelled so: the compiled kernels' rounding differs in the last
bits, not in the quantization grids.

--graph G.onnx: instead of the `--auto` rules, the perplexity of the choice `qwc optimize
--act-scale` recorded in G (a graph of SmolLM2 with qwc's default PTQ, `--lm-head-bits 8`):
its linears row-asym, the others block, beside the all-block row.
"""

from __future__ import annotations

import argparse
import re

import numpy as np

MODES = ("block", "row", "row-asym")


def fake_quantize(x, mode: str):
    """x [..., K] through int8 activations of `mode` and back."""
    import torch

    if mode == "block":
        b = x.reshape(*x.shape[:-1], -1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d)))
        return (q * d).reshape(x.shape)
    if mode == "row":
        d = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / torch.where(d > 0, d, torch.ones_like(d))).clamp(-127, 127) * d
    if mode == "row-asym":
        lo = torch.minimum(x.amin(-1, keepdim=True), torch.zeros_like(x[..., :1]))
        hi = torch.maximum(x.amax(-1, keepdim=True), torch.zeros_like(x[..., :1]))
        s = (hi - lo) / 255
        s = torch.where(s > 0, s, torch.ones_like(s))
        zp = torch.round(-lo / s) - 128
        q = (torch.round(x / s) + zp).clamp(-128, 127)
        return (q - zp) * s
    raise ValueError(mode)


def kind_of(name: str) -> tuple[str, int]:
    """(the linear's input kind, layer): q/k/v read one tensor, gate/up another."""
    m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj", name)
    if not m:
        return name, -1
    p = m.group(2)
    return {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate/up", "up": "gate/up", "down": "down"}[p], int(m.group(1))


def quantized_model():
    """SmolLM2 in torch with qwc's default PTQ weights (Q4_0 linears, Q8_0 tied embedding)."""
    import torch

    from qwc.eval.data import resolve_model
    from qwc.eval.scorers import TorchScorer
    from qwc.q4 import dequantize_q8_0, fake_quantize_q4_0, quantize_q8_0

    s = TorchScorer(resolve_model("smollm2"))
    with torch.no_grad():
        for name, mod in s.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and "layers." in name:
                w = mod.weight.detach().float().numpy()
                mod.weight.copy_(torch.from_numpy(fake_quantize_q4_0(w, 32)))
        emb = s.model.get_input_embeddings()
        e = emb.weight.detach().float().numpy()
        q, d = quantize_q8_0(e, 32)
        emb.weight.copy_(torch.from_numpy(dequantize_q8_0(q, d, e.shape[1]).reshape(e.shape)))
    return s


def linears(model):
    import torch

    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def output_errors(scorer, windows: np.ndarray) -> dict[str, dict[str, float]]:
    """{linear: {mode: ||W q(x) - W x|| / ||W x||}} over the calibration windows."""
    import torch
    import torch.nn.functional as F

    acc: dict[str, dict[str, list[float]]] = {}

    def hook(name):
        def pre(mod, args):
            x = args[0].float()
            ref = F.linear(x, mod.weight)
            a = acc.setdefault(name, {m: [0.0, 0.0] for m in MODES})
            for m in MODES:
                a[m][0] += float((F.linear(fake_quantize(x, m), mod.weight) - ref).square().sum())
                a[m][1] += float(ref.square().sum())
        return pre

    handles = [mod.register_forward_pre_hook(hook(n)) for n, mod in linears(scorer.model)]
    try:
        with torch.inference_mode():
            for w in windows:
                scorer.model(torch.tensor([w.tolist()], dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return {n: {m: (e / max(r, 1e-30)) ** 0.5 for m, (e, r) in v.items()} for n, v in acc.items()}


def perplexity_with(scorer, plan: dict[str, str], chunks: int) -> float:
    """Perplexity with each linear's input in its plan's format (absent: float)."""
    from qwc.eval.data import novel
    from qwc.eval.metrics import perplexity

    def hook(mode):
        def pre(mod, args):
            return (fake_quantize(args[0], mode),) + tuple(args[1:])
        return pre

    handles = [mod.register_forward_pre_hook(hook(plan[n])) for n, mod in linears(scorer.model) if n in plan]
    try:
        return perplexity(scorer, novel("prideprejudice").read_text(), 512, chunks).ppl
    finally:
        for h in handles:
            h.remove()


def graph_plan(path: str, errs: dict) -> dict[str, str]:
    """{linear: mode} of the per-token choice a graph records (by weight name: its MatMulNBits
    node names the module)."""
    import onnx

    from qwc.compiler.row_activations import chosen

    m = onnx.load(path, load_external_data=False)
    rows = chosen(m)
    modules = {n.name.rsplit(".MatMulNBits", 1)[0] for n in m.graph.node
               if n.op_type == "MatMulNBits" and n.input[1] in rows}
    unknown = modules - set(errs)
    if unknown:
        raise SystemExit(f"act_scale.py: {path} names linears SmolLM2 does not have: {sorted(unknown)[:3]}")
    return {n: ("row-asym" if n in modules else "block") for n in errs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--calib-windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--auto", default="row:0.01,row-asym:0.01,row-asym:0.02",
                    help="auto rules MODE:T, comma-separated (MODE row or row-asym)")
    ap.add_argument("--graph", help="a graph `qwc optimize --act-scale` wrote: its choice's perplexity")
    a = ap.parse_args()
    import torch

    from qwc import progress
    from qwc.eval.data import calibration_ids

    progress.set_quiet(True)
    torch.set_num_threads(a.threads)
    s = quantized_model()
    windows = calibration_ids("austen:emma", s.tokenizer, 512 * a.calib_windows).reshape(-1, 512)
    errs = output_errors(s, windows)
    by_kind: dict[str, list] = {}
    for name, e in errs.items():
        by_kind.setdefault(kind_of(name)[0], []).append((kind_of(name)[1], e))
    print("relative output error of each linear (calibration: Emma, "
          f"{a.calib_windows} x 512 tokens), mean and worst layer")
    print("| input | linears | block | row | row-asym | row / block (mean) | worst row / block (layer) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, v in by_kind.items():
        mean = {m: float(np.mean([e[m] for _, e in v])) for m in MODES}
        worst = max(v, key=lambda le: le[1]["row"] / le[1]["block"])
        print(f"| {kind} | {len(v)} | {mean['block']:.4f} | {mean['row']:.4f} | {mean['row-asym']:.4f} | "
              f"{mean['row'] / mean['block']:.2f} | {worst[1]['row'] / worst[1]['block']:.2f} ({worst[0]}) |")
    down = sorted((layer, e) for layer, e in by_kind.get("down", []))
    print("\ndown_proj by layer: row error / block error")
    print(" ".join(f"{layer}:{e['row'] / e['block']:.1f}" for layer, e in down))
    autos = {}
    for rule in a.auto.split(","):
        mode, t = rule.split(":")
        autos[f"auto: {mode} where its error <= block's + {t}"] = {
            n: (mode if e[mode] <= e["block"] + float(t) else "block") for n, e in errs.items()}
    plans = {"weights only (float activations)": {}, **{f"all {m}": {n: m for n in errs} for m in MODES}, **autos}
    if a.graph:
        autos = {f"qwc optimize --act-scale ({a.graph})": graph_plan(a.graph, errs)}
        plans = {"all block": {n: "block" for n in errs}, **autos}
    print(f"\nperplexity, Pride and Prejudice, ctx 512, {a.chunks} chunks (torch simulation)")
    print("| activations | linears on rows | PPL |")
    print("| --- | ---: | ---: |")
    for label, plan in plans.items():
        rows = sum(1 for m in plan.values() if m.startswith("row"))
        print(f"| {label} | {rows} / {len(errs)} | {perplexity_with(s, plan, a.chunks):.3f} |", flush=True)
    for label, plan in autos.items():
        rows = {}
        for n, m in plan.items():
            rows.setdefault(kind_of(n)[0], [0, 0])[m != "block"] += 1
        print(f"\n{label}: rows / linears by input: "
              + ", ".join(f"{k} {r} / {b + r}" for k, (b, r) in rows.items()))


if __name__ == "__main__":
    main()
