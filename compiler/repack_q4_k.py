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

    from .kernels.row_groups import rows_last

    factors = q4_k_factors(scales, mins, free)
    if factors is None:
        return None
    d, sc, dmin, mn = factors
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


def q4_k_gather(model: onnx.ModelProto, features) -> int:
    """An untied Q4_K embedding table (models/stream_export.py: a GatherBlockQuantized of its
    codes and scales d sc, plus a Gather of its block offsets c = m + 8 d sc, added) made one
    gather of the file's factors in kernels/q4_k_scales.py's form (ARM's six-bit pairs on ARM),
    which generic.gather_q4_k_compact reads: the file's 4.5 bits a weight on ARM, 4.625 on x86,
    where the expanded scales and offsets took 6 (a 7B's table is 545M weights). Taken where
    the factors come back exactly and give the graph's offsets to the bit (a Q4_1 table's do
    not); else the table stays as it is. Returns the tables rewritten."""
    from qwc import weight_formats

    graph = Graph(model)
    inits, consumers, producer = graph.inits, graph.consumers, graph.producer
    dots = kernels_for(features).int_dots
    for node in model.graph.node:
        if node.op_type != "GatherBlockQuantized":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        fmt = weight_formats.marked(node)   # (a graph exported before the table was marked has none:
        if (fmt is not None and fmt.name != "Q4_K") or attrs.get("bits") != 4 or attrs.get("block_size") != 32:
            continue                        # its factors coming back to the bit say Q4_K then)
        parts = _offset_gather(node, inits, consumers, producer)
        if parts is None:
            continue
        add, gather, scale_src = parts
        codes = tensor_array(inits[node.input[0]])
        s = tensor_array(inits[scale_src]).astype(np.float32).reshape(codes.shape[:2])
        c = tensor_array(inits[gather.input[0]]).astype(np.float32).reshape(codes.shape[:2])
        if codes.shape[1] % (SUPER // 32):
            continue
        factors = _table_factors(codes, s, c, dots.isa if dots else "x86")
        if factors is None:
            continue
        ws, wc = factors
        stem = node.input[0]
        names = (stem + ".qwc_q4_k_sc_mn", stem + ".qwc_q4_k_d")
        for name, a in zip(names, (ws, wc)):
            model.graph.initializer.append(new_tensor(a, name))
        unsq = producer.get(node.input[2])
        dead = [gather, add] + ([unsq] if unsq is not None else [])
        old = [gather.input[0], scale_src] + ([x for x in unsq.input] if unsq is not None else [])
        del node.input[2:]
        node.input.extend(names)
        node.output[0] = add.output[0]
        node.attribute.append(helper.make_attribute(Q4_K_SCALES_ATTR, 1))
        for n in dead:
            model.graph.node.remove(n)
        for name in old:
            if name in inits and not any(name in x.input for x in model.graph.node):
                model.graph.initializer.remove(inits.pop(name))
        return 1
    return 0


def _offset_gather(node, inits, consumers, producer):
    """(the Add, the offsets' Gather, the scales' initializer) of the export's untied table
    gather `node`, or None where the graph is not that form or something else reads its codes,
    scales or offsets (a tied head)."""
    readers = consumers.get(node.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    gather = producer.get(other)
    if gather is None or gather.op_type != "Gather" or gather.input[1] != node.input[1]:
        return None
    unsq = producer.get(node.input[2])
    scale_src = unsq.input[0] if unsq is not None and unsq.op_type == "Unsqueeze" else node.input[2]
    only = {node.input[0]: node, gather.input[0]: gather, scale_src: unsq or node}
    if unsq is not None and consumers.get(unsq.output[0], []) != [node]:
        return None
    if any(x not in inits or consumers.get(x, []) != [r] for x, r in only.items()):
        return None
    if len(consumers.get(gather.output[0], [])) != 1:
        return None
    return add, gather, scale_src


def _table_factors(codes: np.ndarray, s: np.ndarray, c: np.ndarray, isa: str):
    """compact_scales of a table's d sc `s` and block offsets c = m + 8 d sc [V, K/32], or
    None. c was rounded to float32 (models/stream_export.py), so c - 8 d sc is m only nearly:
    each super-block's dmin and mn are the fp16 and 6-bit integers (the largest mn tried from
    63 down, as six_bit_factors does) that give its c again to the bit."""
    n, nb = s.shape
    v = -(c.astype(np.float64) - 8 * s.astype(np.float64)).reshape(n, -1, 8)   # dmin mn, nearly
    cc, ss = c.reshape(v.shape), 8 * s.astype(np.float64).reshape(v.shape)
    top = v.max(-1)
    dmin, mn = np.zeros(top.shape, np.float32), np.zeros(v.shape, np.uint8)
    todo = np.ones(top.shape, bool)
    for j in range(63, 0, -1):
        at = np.flatnonzero(todo)
        if not at.size:
            break
        cand = (np.maximum(top.reshape(-1)[at], 0) / j).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(v.reshape(-1, 8)[at] / np.where(cand > 0, cand, 1)[:, None]), 0, 63) * (cand > 0)[:, None]
        back = (ss.reshape(-1, 8)[at] - cand[:, None].astype(np.float64) * q).astype(np.float32)
        ok = (back == cc.reshape(-1, 8)[at]).all(-1)
        dmin.reshape(-1)[at[ok]], mn.reshape(-1, 8)[at[ok]] = cand[ok], q[ok]
        todo.reshape(-1)[at[ok]] = False
    if todo.any():
        return None
    mins = -(np.repeat(dmin, 8, axis=1) * mn.reshape(n, nb)).astype(np.float32)
    return compact_scales(s, mins, ~codes.any(-1), isa)
