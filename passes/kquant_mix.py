"""Which llama.cpp format each linear takes under `qwc optimize --format MIX`: the mix of
llama.cpp's file type of that name (its llama-quant.cpp decides, for a Qwen2 or Llama model).

- the output matrix (or the tied embedding, which is the output): Q6_K in every mix;
- q4_k_m: attn_v and ffn_down of the layers `more_bits` picks (the first and last eighth, and
  every third one between) Q6_K, every other linear Q4_K;
- q5_k_m: the same with Q5_K for Q4_K;
- q4_k_s: attn_v of the first four layers and ffn_down of the first eighth Q5_K, the rest Q4_K;
- q6_k: every linear Q6_K;
- a tensor whose rows are not whole super-blocks of 256 falls back: Q4_K to Q5_0, Q5_K to Q5_1,
  Q6_K to Q8_0 (SmolLM2's hidden size 576 and Qwen2.5-0.5B's 896 make most of their linears
  Q5_0 or Q5_1).

Q6_K's places are Q6_K (compiler/repack_q6_k.py runs them on their own kernels, or as Q8_0 on a
target without one). A tied embedding is the output (the embedding pass: Q6_K, or Q8_0 where
its rows fall back); an untied one keeps `--lm-head-bits`.
"""

from __future__ import annotations

import re

from qwc import weight_formats

FORMATS = ("q4_0", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k")
SUPER = 256   # a K-quant super-block
# bits a weight of each format the mixes write, with its scales (the summary's bits-per-weight
# figure), and a super-block format's own fallback where rows are not whole super-blocks
# (llama.cpp's): qwc/weight_formats.py's records
BITS = {f.name: f.bits_per_weight for f in weight_formats.FORMATS.values() if f.quantizer or f.name == "Q8_0"}
FALLBACK = {f.name: f.fallback for f in weight_formats.FORMATS.values() if f.fallback}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers whose attn_v / ffn_down get more bits in Q4_K_M and Q5_K_M."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def llama_type(module: str, layers: int, mix: str = "q4_k_m") -> str:
    """llama.cpp's type of a linear in `mix` by its module name, before the row-length fallback."""
    if module == "lm_head" or mix == "q6_k":
        return "Q6_K"
    base = "Q5_K" if mix == "q5_k_m" else "Q4_K"
    m = re.search(r"layers\.(\d+)\.", module)
    if m is None or not module.endswith(("v_proj", "down_proj")):
        return base
    layer = int(m.group(1))
    if mix == "q4_k_s":   # (llama.cpp counts attn_v tensors and ffn_down layers: one a layer here)
        return "Q5_K" if layer < (4 if module.endswith("v_proj") else layers // 8) else base
    return "Q6_K" if more_bits(layer, layers) else base


def linear_format(module: str, k: int, layers: int, mix: str = "q4_k_m") -> str:
    """The format qwc writes for a linear of K inputs under `mix`: Q4_K, Q5_K, Q6_K, or their
    fallbacks Q5_0, Q5_1, Q8_0."""
    kind = llama_type(module, layers, mix)
    return kind if k % SUPER == 0 else FALLBACK[kind]
