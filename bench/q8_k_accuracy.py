"""Q8_K activations against Q8_0's on the same weights: what ARM's super-block scales cost in
perplexity, simulated in torch.

    .venv/bin/python bench/q8_k_accuracy.py [--mix Q4_K_M] [--chunks 40] [--ctx 512]

An ARM graph with compact Q4_K quantizes every linear's input whose K is whole super-blocks of
256 with one scale a super-block (llama.cpp's Q8_K: compiler/kernels/act_quant.py's
`super_blocks`), and the others with one a block of 32 (Q8_0), as every x86 build does. Here
SmolLM2-135M-Instruct requantized by llama-quantize to `--mix` (bench/llamacpp.sh x86) runs in
torch with the file's weights dequantized, and a forward pre-hook rounds each linear's input
(the lm_head's included) as the kernels' quantizers do: d = amax / 127 over the block or
super-block, q = x / d rounded half away from zero, x = q d. Rows: float activations; Q8_0
everywhere (the x86 build's numerics); ARM's rule (Q8_K where K allows). Perplexity on Pride
and Prejudice, llama.cpp's protocol (the first `--chunks` x `--ctx` tokens, the second half of
each chunk scored), as bench/accuracy.py scores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BLOCK, SUPER = 32, 256


def fake_quant(x, width: int):
    """x [..., K] rounded to int8 codes a `width` of the last axis shares one scale (amax / 127)."""
    import torch

    k = x.shape[-1]
    whole = k - k % width
    parts = []
    if whole:
        v = x[..., :whole].reshape(*x.shape[:-1], whole // width, width)
        d = v.abs().amax(-1, keepdim=True) / 127
        r = torch.where(d > 0, v / torch.where(d > 0, d, 1), 0)
        parts.append((torch.sign(r) * torch.floor(r.abs() + 0.5) * d).reshape(*x.shape[:-1], whole))
    if whole < k:   # a last partial group: its own scale
        parts.append(fake_quant(x[..., whole:], k - whole))
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def hook_linears(model, rule: str) -> list:
    """Forward pre-hooks rounding every linear's input: "q8_0" blocks of 32; "arm" super-blocks
    of 256 where K is whole super-blocks, else blocks."""
    import torch

    def hook(mod, args):
        k = args[0].shape[-1]
        width = SUPER if rule == "arm" and k % SUPER == 0 else BLOCK
        return (fake_quant(args[0].float(), width).to(args[0].dtype), *args[1:])

    return [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def main() -> None:
    from qwc.bench.accuracy import llamacpp_quantized
    from qwc.bench.llamacpp import tools as llamacpp_tools
    from qwc.eval.data import novel, smollm2_path
    from qwc.eval.metrics import perplexity
    from qwc.eval.scorers import TorchScorer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", default="Q4_K_M", help="llama-quantize's type for SmolLM2")
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "qwc" / "kquant_files")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf = llamacpp_quantized(llamacpp_tools("x86"), smollm2_path(), args.workdir / f"smollm2-{args.mix}.gguf",
                              kind=args.mix)
    scorer = TorchScorer(str(gguf), threads=args.threads)
    widths = sorted({m.in_features for m in scorer.model.modules() if hasattr(m, "in_features")})
    text = novel("prideprejudice").read_text()
    print(f"SmolLM2 {args.mix} (llama-quantize), Pride and Prejudice, {args.chunks} x {args.ctx} tokens; "
          f"linear inputs of K {widths} (Q8_K where K % {SUPER} == 0)\n")
    print("| activations | perplexity | / Q8_0 |")
    print("| --- | ---: | ---: |")
    base = None
    for name, rule in (("float", None), ("Q8_0 (x86)", "q8_0"), ("Q8_K where K allows (ARM)", "arm")):
        hooks = hook_linears(scorer.model, rule) if rule else []
        try:
            r = perplexity(scorer, text, ctx=args.ctx, chunks=args.chunks)
        finally:
            for h in hooks:
                h.remove()
        base = r.ppl if rule == "q8_0" else base
        ratio = f"{r.ppl / base:.4f}x" if base and rule else "-"
        print(f"| {name} | {r.ppl:.4f} ± {r.ppl_err:.4f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
