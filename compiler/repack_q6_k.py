"""Compile-time handling of llama.cpp's Q6_K linears (MatMulNBits, 8-bit codes q + 96 in blocks
of 16 with float32 scales d sc: models/gguf_blocks.py).

Where the target has a Q6_K kernel (targets.q6_k_path: kernels/x86/q6_k.py, kernels/arm/q6_k.py)
the weights go into its layout: the codes in the W8A8 row groups' order (row_groups.pack_int8),
at six bits, 6 chunks a block, in each ISA's own arrangement (x86: six_bit_codes, q in 0..63;
ARM: arm_six_bit_codes, q - 32 as six-bit two's complement, read as 4 (q - 32)); the int8
sub-block scales sc [G, NB, 32] and the super-block scales d [G, NB/8, 16] float32 (on ARM
float16, the file's bytes, where every d is an fp16, as llama.cpp's are), the pair taken back
from the products by gguf_blocks.q6_k_factors. The node is marked
graph.Q6_K_ATTR with inputs (x, codes, sc, "", "", bias, d).

Elsewhere (AVX2, arm-neon without dotprod, float activations) each Q6_K weight is
quantized again as Q8_0, which those targets run natively: the closest format they have, not
the file's values. A message says so, naming the count.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc import progress, weight_formats
from qwc.passes.graph import Q6_K_ATTR, Graph, matmul_nbits_dims, new_tensor, tensor_array

from .targets import q6_k_path

SUB = 16
SUPER = 256
# pack's and _as_q8_0's chunk of rows (whole row groups): a 7B output's float32 rows 56 MB at a
# time, not 2.2 GB
ROWS_AT_ONCE = 4096


def is_q6_k(node: onnx.NodeProto) -> bool:
    """A MatMulNBits whose weight format is Q6_K (qwc/weight_formats.py)."""
    return node.op_type == "MatMulNBits" and weight_formats.format_of(node).name == "Q6_K"


def pack(u: np.ndarray, s: np.ndarray, isa: str = "x86") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes u [N, K/16, 16] (q + 96) and scales d sc [N, K/16] -> the `isa` kernel's codes
    [G, K/32, 6, 64] (x86: six_bit_codes; arm: arm_six_bit_codes), sc [G, K/32, 32] int8 and
    d [G, K/256, 16] float32 (arm: float16 where every d is one). Rows past N are zeros (q = 32)."""
    from qwc.models.gguf_blocks import q6_k_factors

    from .kernels.row_groups import ROWS, groups, pack_int8

    if isa not in ("x86", "arm"):
        raise ValueError(f"no Q6_K kernel layout for {isa!r}")
    n, nsub, _ = u.shape
    nb = nsub // 2
    d, sc = q6_k_factors(s)

    def codes(r: int) -> np.ndarray:   # rows r .. r + ROWS_AT_ONCE (whole row groups) in the layout
        rows = u[r:r + ROWS_AT_ONCE].reshape(-1, nb, 32)
        w, _ = pack_int8(rows, np.ones(rows.shape[:2], np.float32), signed=isa == "arm")
        # u = q + 96 -> q (rows past N: 32); arm: q - 32 in two's complement
        return six_bit_codes(w - np.uint8(96)) if isa == "x86" else arm_six_bit_codes(w)

    # a chunk of rows at a time: a 7B output's layouts whole took 1.1 GB more of temporaries
    g = groups(n)
    first = codes(0)
    w = np.empty((g, *first.shape[1:]), np.uint8)
    for r in range(0, n, ROWS_AT_ONCE):
        part = first if r == 0 else codes(r)
        w[r // ROWS:r // ROWS + len(part)] = part
    scp = np.zeros((g * ROWS, nb, 2), np.int8)
    scp[:n] = sc.reshape(n, nb, 2)
    scp = scp.reshape(g, ROWS, nb, 2).transpose(0, 2, 3, 1).reshape(g, nb, 2 * ROWS)   # [g, b, A rows, B rows]
    dp = np.zeros((g * ROWS, nsub * SUB // SUPER), np.float32)
    dp[:n] = d
    dp = dp.reshape(g, ROWS, -1).transpose(0, 2, 1)
    if isa == "arm" and np.array_equal(dp.astype(np.float16).astype(np.float32), dp):
        dp = dp.astype(np.float16)   # the file's two bytes a super-block and row, not four
    return w, np.ascontiguousarray(scp), np.ascontiguousarray(dp)


def six_bit_codes(q: np.ndarray) -> np.ndarray:
    """Codes q [G, NB, 8, 64] in 0..63 (the W8A8 row-group chunks) -> [G, NB, 6, 64]: chunks
    0-3 hold the low four bits of chunk c in their low nibbles and of chunk c + 4 in their high
    ones; chunks 4 and 5 the top two bits of chunks 4j .. 4j + 3 at bits 0-1, 2-3, 4-5 and 6-7
    (kernels/x86/q6_k.py: codes)."""
    if q.max(initial=0) > 63:
        raise ValueError("six-bit codes above 63")
    nib = (q[:, :, :4] & 15) | ((q[:, :, 4:] & 15) << 4)
    top = (q >> 4).reshape(*q.shape[:2], 2, 4, q.shape[-1])
    high = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    return np.ascontiguousarray(np.concatenate([nib, high], axis=2).astype(np.uint8))




def arm_six_bit_codes(q: np.ndarray) -> np.ndarray:
    """Signed codes q - 32 [G, NB, 8, 64] (the W8A8 row-group chunks, as uint8) -> [G, NB, 6, 64]:
    of chunks 4h .. 4h + 3, with t = (q - 32) mod 64, chunk 3h holds 4 t0 plus t3's bits 4-5,
    3h + 1 holds 4 t1 plus its bits 2-3, 3h + 2 holds 4 t2 plus its bits 0-1
    (kernels/arm/q6_k.py: _codes)."""
    t = q & np.uint8(63)
    out = np.empty((*q.shape[:2], 6, q.shape[-1]), np.uint8)
    for h in range(2):
        t0, t1, t2, t3 = (t[:, :, 4 * h + j] for j in range(4))
        out[:, :, 3 * h] = (t0 << 2) | (t3 >> 4)
        out[:, :, 3 * h + 1] = (t1 << 2) | ((t3 >> 2) & 3)
        out[:, :, 3 * h + 2] = (t2 << 2) | (t3 & 3)
    return out


def _as_q8_0(u: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K codes u [N, K/16, 16] and scales [N, K/16] quantized again as Q8_0: codes q + 128
    [N, K/32, 32] uint8 and scales [N, K/32], a chunk of rows at a time."""
    from qwc.q4 import quantize_q8_0

    n, nsub, _ = u.shape
    codes = np.empty((n, nsub // 2, 32), np.uint8)
    d = np.empty((n, nsub // 2), np.float32)
    for r in range(0, n, ROWS_AT_ONCE):
        rows = slice(r, min(r + ROWS_AT_ONCE, n))
        w = ((u[rows].astype(np.float32) - 128) * s[rows, :, None]).reshape(rows.stop - rows.start, -1)
        q8, d[rows] = quantize_q8_0(w, 32)
        codes[rows] = (q8.astype(np.int16) + 128).astype(np.uint8)
    return codes, d


def _tied_gathers(graph: Graph, codes: str, scales: str) -> list[tuple[onnx.NodeProto, onnx.NodeProto | None]]:
    """The GatherBlockQuantized nodes reading a Q6_K matmul's codes (a tied embedding), each with
    the Unsqueeze it reads the scales through (passes/quantize_embedding.py's form), or None."""
    out = []
    for c in graph.consumers.get(codes, []):
        if c.op_type != "GatherBlockQuantized":
            continue
        src = graph.producer.get(c.input[2])
        out.append((c, src if src is not None and src.op_type == "Unsqueeze" and src.input[0] == scales else None))
    return out


def _point_gathers(model: onnx.ModelProto, gathers, codes: str, scales: str, d: str | None) -> None:
    """Point tied gathers at the matmul's new weights: with `d`, the Q6_K kernel's (codes, sc, d,
    marked Q6_K_ATTR: generic.gather_q6_k_row_groups); without, Q8_0 blocks of 32 (codes, scales
    through the same Unsqueeze), which repack.repack_weights then shares with the matmul."""
    for g, unsqueeze in gathers:
        g.input[0] = codes
        if d is not None:
            g.input[2] = scales
            del g.input[3:]
            g.input.append(d)
            g.attribute.append(helper.make_attribute(Q6_K_ATTR, 1))
            if unsqueeze is not None and not any(unsqueeze.output[0] in n.input for n in model.graph.node):
                model.graph.node.remove(unsqueeze)
        else:
            for a in g.attribute:
                if a.name == "block_size":
                    a.i = 32
            if unsqueeze is not None:
                unsqueeze.input[0] = scales
            else:
                g.input[2] = scales + "3"   # q6_k_linears' [V, nb, 1] copy


def q6_k_linears(model: onnx.ModelProto, act_bits: int, features) -> tuple[int, int]:
    """Repack each Q6_K MatMulNBits for the target's kernel, or quantize it as Q8_0 where it
    has none; a tied embedding's gathers follow it. Returns (kept, requantized)."""
    from qwc.models.gguf_blocks import Q6_K_BLOCK

    graph = Graph(model)
    inits = graph.inits
    kept = requantized = 0
    for node in model.graph.node:
        if not is_q6_k(node) or node.input[1] not in inits or node.input[2] not in inits:
            continue
        k, n, _, _ = matmul_nbits_dims(node)
        u, s = tensor_array(inits[node.input[1]]), tensor_array(inits[node.input[2]]).astype(np.float32)
        if u.shape != (n, k // Q6_K_BLOCK, Q6_K_BLOCK) or k % SUPER:
            continue   # the importer names what it cannot take
        old = list(node.input[1:3])
        gathers = _tied_gathers(graph, *old)
        bias = node.input[5] if len(node.input) > 5 else ""
        stem = node.input[1]
        del node.input[1:]
        if isa := q6_k_path(Q6_K_BLOCK, 8, act_bits, features):
            w, sc, d = pack(u, s.reshape(n, -1), isa)
            names = [stem + ".qwc_q6_k", stem + ".qwc_q6_k_sc", stem + ".qwc_q6_k_d"]
            for name, a in zip(names, (w, sc, d)):
                model.graph.initializer.append(new_tensor(a, name))
            node.input.extend([names[0], names[1], "", "", bias, names[2]])
            node.attribute.append(helper.make_attribute(Q6_K_ATTR, 1))
            _point_gathers(model, gathers, *names)
            kept += 1
        else:
            codes, d = _as_q8_0(u, s.reshape(n, -1))
            names = [stem + ".qwc_q8_0", stem + ".qwc_q8_0_scales"]
            model.graph.initializer.append(new_tensor(codes, names[0]))
            model.graph.initializer.append(new_tensor(d, names[1]))
            node.input.extend(names + ([] if not bias else ["", "", bias]))
            if any(unsq is None for _, unsq in gathers):   # a gather reading folded [V, nb, 1] scales
                model.graph.initializer.append(new_tensor(d[..., None], names[1] + "3"))
            _point_gathers(model, gathers, *names, None)
            for a in node.attribute:
                if a.name == "block_size":
                    a.i = 32
            weight_formats.mark(node, "Q8_0")
            requantized += 1
        for name in old:
            if not any(name in nd.input for nd in model.graph.node):
                model.graph.initializer.remove(inits.pop(name))
    if requantized:
        progress.info(f"[qwc] {requantized} Q6_K linears as Q8_0: this target has no Q6_K kernel "
                      "(close to the file's values, not exact)")
    return kept, requantized
