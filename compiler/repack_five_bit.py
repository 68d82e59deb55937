"""A GGUF's Q5_0, Q5_1 and Q5_K linears stored as five-bit codes where the target has a kernel
for them (targets.IntDots.q5: x86 VNNI's "vnni5", ARM's "sdot5"), not as the bytes the
canonical graph holds.

Their MatMulNBits hold 8-bit codes u whose values span 32 (models/gguf_blocks.py): Q5_1 / Q5_K
u = q + 128 with each block's minimum m as block offsets (compiler/block_minimums.py), Q5_0
u = q - 16 + 128. Both become codes q in 0..31 (row_groups.pack_five_bit: 5 bits a weight,
against 8), which the kernels read as Q4_0's nibbles are read: their sums start at -8 sum(a),
so w = d (q - 8) + c a block, c = m + 8 d (rounded once, as Q4_K's c), or Q5_0's -8 d (exact);
the block offsets add c times the activations' block sum, one FMA a block
(kernels/x86/vnni.py: _codes rebuilds each chunk of codes from its nibbles and its bit; ARM's
kernels/arm/dotprod.py: _five_bit_codes). A Q5_K tensor keeps the file's factors as a compact
Q4_K does (kernels/q4_k_scales.py: 6-bit sc and mn a block, fp16 d and dmin a super-block, so
5.625 bits a weight on x86 and the file's 5.5 on ARM),
where they come back (repack_q4_k.compact_scales); else float32 d sc and c (7 bits). A weight
something else reads too (a tied embedding's gather) keeps its bytes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc import weight_formats
from qwc.passes.graph import (
    BLOCK_OFFSETS_ATTR,
    FIVE_BIT_ATTR,
    Q4_K_SCALES_ATTR,
    Graph,
    has_block_offsets,
    has_zero_points,
    matmul_nbits_dims,
    new_tensor,
    tensor_array,
)

from .repack_q4_k import SUPER, compact_scales
from .targets import five_bit_path, kernels_for

SPAN = 32   # five bits' codes


def is_five_bit(node) -> bool:
    return any(a.name == FIVE_BIT_ATTR and a.i for a in node.attribute)


def five_bit_codes(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Rewrite in place each MatMulNBits whose 8-bit codes fit five bits (see above) for the
    target's five-bit kernel; returns the count."""
    from .kernels import row_groups

    graph = Graph(model)
    inits, consumers = graph.inits, graph.consumers
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or is_five_bit(node) or has_zero_points(node):
            continue
        k, n, block, bits = matmul_nbits_dims(node)
        fmt = weight_formats.format_of(node)
        # Q5_0, Q5_1 and Q5_K by their format; an unmarked graph's Q5_0 is read as Q8_0, and
        # taken here where its codes fit five bits (the check below), as before markers
        if "five_bit_codes" not in fmt.rewrites and weight_formats.marked(node) is not None:
            continue
        if five_bit_path(block, bits, act_bits, features) is None:
            continue
        wname, sname = node.input[1], node.input[2]
        if wname not in inits or sname not in inits or len(consumers.get(wname, [])) != 1:
            continue
        u, d = tensor_array(inits[wname]), tensor_array(inits[sname]).astype(np.float32)
        minimums = has_block_offsets(node)
        low = 128 if minimums else 128 - SPAN // 2
        if u.ndim != 3 or u.min() < low or u.max() >= low + SPAN:
            continue
        q = u - np.uint8(low)
        w, s = row_groups.pack_five_bit(q, d)
        m = tensor_array(inits[node.input[3]]) if minimums else None
        isa = kernels_for(features).int_dots.isa   # (compact_scales' form: ARM's six-bit pairs)
        compact = compact_scales(d, m, ~q.any(-1), isa) if fmt.name == "Q5_K" and k % SUPER == 0 else None
        if compact is not None:   # Q5_K with the file's factors (kernels/q4_k_scales.py), as compact Q4_K
            s, c = compact
            node.attribute.append(helper.make_attribute(Q4_K_SCALES_ATTR, 1))
        else:   # the kernels' sums start at -8 sum(a) (their codes count from 8): c = m + 8 d, or Q5_0's -8 d
            c = row_groups.pack_offsets((8 * d.astype(np.float64) + (m if minimums else -16 * d)).astype(np.float32))
        names = (wname + ".qwc_five_bit", sname + ".qwc_five_bit", wname + ".qwc_five_bit_offsets")
        for name, a in zip(names, (w, s, c)):
            model.graph.initializer.append(new_tensor(a, name))
        old = [wname, sname] + ([node.input[3]] if minimums else [])
        bias = node.input[5] if len(node.input) > 5 else ""
        del node.input[1:]
        node.input.extend([names[0], names[1], names[2]] + (["", bias] if bias else []))
        if not minimums:
            node.attribute.append(helper.make_attribute(BLOCK_OFFSETS_ATTR, 1))
        node.attribute.append(helper.make_attribute(FIVE_BIT_ATTR, 1))
        for name in old:
            if not any(name in x.input for x in model.graph.node):
                model.graph.initializer.remove(inits.pop(name))
        count += 1
    return count
