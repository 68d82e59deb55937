"""Which llama.cpp format each linear takes under `qwc optimize --format q4_k_m`: the mix of
llama.cpp's Q4_K_M (its llama-quant.cpp decides, for a Qwen2 or Llama model), less the formats
qwc has no kernels for yet.

llama.cpp's Q4_K_M for these models:
- the output matrix (or the tied embedding, which is the output): Q6_K;
- attn_v and ffn_down of the layers `more_bits` picks (the first and last eighth, and every
  third one between): Q6_K;
- every other linear: Q4_K;
- a tensor whose rows are not whole super-blocks of 256 falls back: Q4_K to Q5_0, Q6_K to Q8_0
  (SmolLM2's hidden size 576 and Qwen2.5-0.5B's 896 make most of their linears Q5_0).

qwc keeps that mix: Q6_K's places are Q6_K (compiler/repack_q6_k.py runs them on their own
kernels, or as Q8_0 on a target without one). A tied embedding is the output (the embedding
pass: Q6_K, or Q8_0 where its rows fall back); an untied one keeps `--lm-head-bits`
(GatherBlockQuantized has no float zero points for Q4_K's minimums).
"""

from __future__ import annotations

import re

FORMATS = ("q4_0", "q4_k_m")
SUPER = 256   # a K-quant super-block
# bits a weight of each format, with its scales (the summary's bits-per-weight figure)
BITS = {"Q4_K": 4.5, "Q5_0": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def llama_type(module: str, layers: int) -> str:
    """llama.cpp's Q4_K_M type of a linear by its module name, before the row-length fallback."""
    if module == "lm_head":
        return "Q6_K"
    m = re.search(r"layers\.(\d+)\.", module)
    if m and module.endswith(("v_proj", "down_proj")) and more_bits(int(m.group(1)), layers):
        return "Q6_K"
    return "Q4_K"


def linear_format(module: str, k: int, layers: int) -> str:
    """The format qwc writes for a linear of K inputs under q4_k_m: Q4_K, Q5_0, Q6_K or Q8_0."""
    kind = llama_type(module, layers)
    if kind == "Q6_K":
        return "Q6_K" if k % SUPER == 0 else "Q8_0"
    return "Q4_K" if k % SUPER == 0 else "Q5_0"
