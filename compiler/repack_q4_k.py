"""Compile-time compact storage of llama.cpp's Q4_K linears for the W4A8 kernels.

The canonical graph holds a Q4_K sub-block as a Q4_1 block: float32 scale d sc and zero point
(models/gguf_blocks.py). Expanded for the kernels, as compiler/repack.py's q4_1_block_offsets
does for Q4_1, that is two float32 a row and block beside 16 bytes of codes: 6 bits a weight
against the file's 4.5. Here the file's factors are taken back instead
(gguf_blocks.q4_k_factors) and written in kernels/q4_k_scales.py's form, 4.625 bits a weight,
with the same block terms to the bit; on ARM the 6-bit sc and mn are stored at six bits (4.5
bits a weight, the file's), in pairs of blocks.

A Q4_K linear keeps the expanded form where the target's kernels read it so
(targets.IntDots.q4_k_compact off: none of qwc's W4A8 targets today), where its weights have
other readers (a tied embedding's gather reads the expanded scales), and where some
super-block's factors are not an fp16 and 6-bit integers (not written as Q4_K).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc.passes.graph import (
    BLOCK_OFFSETS_ATTR,
    Q4_K_SCALES_ATTR,
    Graph,
    has_zero_points,
    matmul_nbits_dims,
    new_tensor,
    tensor_array,
)

from .targets import kernels_for, q4_0_path

SUPER = 256


def is_compact_q4_k(node: onnx.NodeProto) -> bool:
    return any(a.name == Q4_K_SCALES_ATTR and a.i for a in node.attribute)


def pack(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
         isa: str = "x86") -> tuple[np.ndarray, ...] | None:
    """MatMulNBits Q4_K blocks (codes [N, K/32, 16], scales d sc and zero points [N, K/32]) ->
    the kernels' codes [G, K/32, 4, 64], sc and mn (compact_scales: `isa`'s form) and d and
    dmin [G, K/256, 32] float16 (kernels/q4_k_scales.py), or None where the factors do not
    exist. Rows past N are zeros."""
    from qwc.models.gguf_blocks import block_mins

    from .kernels.row_groups import pack as pack_codes

    n, nb, _ = codes.shape
    s = scales.astype(np.float32)
    factors = compact_scales(s, block_mins(s, zero_points, "q4_k"), ~codes.any(-1), isa)
    if factors is None:
        return None
    w, _ = pack_codes(codes, np.ones((n, nb), np.float16))
    return (w, *factors)


def compact_scales(scales: np.ndarray, mins: np.ndarray, free: np.ndarray,
                   isa: str = "x86") -> tuple[np.ndarray, np.ndarray] | None:
    """A K-quant's sub-block scales d sc and minimums -dmin mn [N, K/32] (Q4_K's, Q5_K's) in
    kernels/q4_k_scales.py's form: sc and mn [G, K/32, 32] uint8 (`isa` "arm": six-bit pairs
    [G, K/64, 48], arm_pairs), d and dmin [G, K/256, 32] float16, or None where the file's
    factors do not come back (gguf_blocks.q4_k_factors; `free`: the blocks whose codes are all
    0). Rows past N are zeros."""
    from qwc.models.gguf_blocks import q4_k_factors

    from .kernels.row_groups import ROWS, groups

    factors = q4_k_factors(scales, mins, free)
    if factors is None:
        return None
    d, sc, dmin, mn = factors
    n = scales.shape[0]
    g = groups(n)

    def rows_last(x: np.ndarray, dtype) -> np.ndarray:   # [N, B] -> [G, B, 16]
        out = np.zeros((g * ROWS, x.shape[1]), dtype)
        out[:n] = x
        return out.reshape(g, ROWS, -1).transpose(0, 2, 1)

    if isa == "arm":
        small = arm_pairs(rows_last(sc, np.uint8), rows_last(mn, np.uint8))
    else:
        small = np.concatenate([rows_last(sc, np.uint8), rows_last(mn, np.uint8)], axis=-1)
    big = np.concatenate([rows_last(d, np.float16), rows_last(dmin, np.float16)], axis=-1)
    return np.ascontiguousarray(small), np.ascontiguousarray(big)


def arm_pairs(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """sc and mn [G, NB, 16] (0..63) -> ARM's six-bit pairs [G, NB/2, 48]: per pair of blocks
    A = sc0 + 64 (mn1 & 3), B = mn0 + 64 ((mn1 >> 2) & 3), C = sc1 + 64 (mn1 >> 4)
    (kernels/q4_k_scales.py: arm_pair reads them)."""
    if max(sc.max(initial=0), mn.max(initial=0)) > 63:
        raise ValueError("six-bit scales above 63")
    sc0, sc1, mn0, mn1 = sc[:, 0::2], sc[:, 1::2], mn[:, 0::2], mn[:, 1::2]
    out = np.concatenate([sc0 | ((mn1 & 3) << 6), mn0 | (((mn1 >> 2) & 3) << 6), sc1 | ((mn1 >> 4) << 6)], axis=-1)
    return np.ascontiguousarray(out.astype(np.uint8))


def q4_k_compact(model: onnx.ModelProto, act_bits: int, features) -> tuple[int, int]:
    """Write each Q4_K MatMulNBits the target's W4A8 kernels take in the compact form, marked
    Q4_K_SCALES_ATTR and BLOCK_OFFSETS_ATTR (repack.py then leaves it alone). Returns (compact,
    left expanded)."""
    from qwc import weight_formats

    graph = Graph(model)
    inits, consumers = graph.inits, graph.consumers
    dots = kernels_for(features).int_dots
    compact = expanded = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or not has_zero_points(node) or weight_formats.format_of(node).name != "Q4_K":
            continue
        k, n, block, bits = matmul_nbits_dims(node)
        if not dots or not dots.q4_k_compact or q4_0_path(block, bits, act_bits, features) != dots.isa or k % SUPER:
            continue   # (not on a W4A8 kernel, or on one that reads Q4_K expanded: IntDots.q4_k_compact)
        names = list(node.input[1:4])
        if any(x not in inits for x in names) or any(c is not node for x in names for c in consumers.get(x, [])):
            expanded += 1   # read elsewhere too (a tied gather): the expanded form all share
            continue
        packed = pack(*(tensor_array(inits[x]) for x in names), dots.isa)
        if packed is None:
            expanded += 1
            continue
        for name, a in zip(names, packed):
            inits[name].CopyFrom(new_tensor(a, name))
        node.attribute.extend([helper.make_attribute(BLOCK_OFFSETS_ATTR, 1),
                               helper.make_attribute(Q4_K_SCALES_ATTR, 1)])
        compact += 1
    return compact, expanded
