"""A GGUF's IQ4_NL and IQ4_XS linears stored as the file's 4-bit indices into llama.cpp's code
book where the target has kernels for them (targets.IntDots.iq4: kernels/code_book.py), not as
the book's values in bytes.

Their MatMulNBits hold 8-bit codes u = book[q] + 128 with a float scale a block of 32
(models/gguf_blocks.py: IQ4_XS's d times its sub-block's 6-bit scale less 32, exact in float32).
Each u maps back to its index q, and the indices take Q4_0's row groups (row_groups.pack, 4 bits
a weight where bytes took 8), which the kernels read as nibbles and look up in the book. IQ4_NL's
scales stay as they are (fp16, the file's). IQ4_XS's sub-block products become the file's
factors again on ARM's kernels (kernels/iq4_xs_scales.py: the 6-bit ls, d a super-block, 4.25
bits a weight in all as in the file; d goes in the node's zero-point input), and stay float32 on
x86's (5 bits a weight). A weight something else reads too (a tied embedding's gather) keeps its
bytes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc import weight_formats
from qwc.passes.graph import IQ4_ATTR, Graph, has_zero_points, matmul_nbits_dims, new_tensor, tensor_array
from qwc.q4 import pack_nibbles

from .targets import iq4_path, kernels_for


def is_iq4(node) -> bool:
    return any(a.name == IQ4_ATTR and a.i for a in node.attribute)


def is_iq4_xs_compact(node) -> bool:
    """Whether an IQ4 linear holds IQ4_XS's own factors (d in its zero-point input: compact_xs)."""
    return node.op_type == "MatMulNBits" and is_iq4(node) and len(node.input) > 3 and bool(node.input[3])


def book_indices(u: np.ndarray, book: tuple[int, ...]) -> np.ndarray | None:
    """The indices q with book[q] + 128 == u (uint8), or None where some code is not the book's."""
    lookup = np.full(256, 255, np.uint8)
    lookup[np.array(book) + 128] = np.arange(len(book), dtype=np.uint8)
    q = lookup[u]
    return None if (q == 255).any() else q


def iq4_indices(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Rewrite in place each IQ4 MatMulNBits the target's kernels take (see above); returns the count."""
    from .kernels import row_groups

    graph = Graph(model)
    inits, consumers = graph.inits, graph.consumers
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or is_iq4(node) or has_zero_points(node):
            continue
        fmt = weight_formats.marked(node)
        _, _, block, bits = matmul_nbits_dims(node)
        if fmt is None or fmt.code_book is None or bits != 8 or iq4_path(block, act_bits, features) is None:
            continue
        wname, sname = node.input[1], node.input[2]
        if wname not in inits or sname not in inits or len(consumers.get(wname, [])) != 1:
            continue
        u = tensor_array(inits[wname])
        q = book_indices(u, fmt.code_book) if u.ndim == 3 else None
        if q is None:
            continue
        d = tensor_array(inits[sname]).astype(np.float32).reshape(u.shape[:2])
        w, s = row_groups.pack(pack_nibbles(q), d)
        factors = (compact_xs(d) if fmt.name == "IQ4_XS" and kernels_for(features).int_dots.isa == "arm"
                   else None)
        arrays = (w, s) if factors is None else (w, *factors)
        names = tuple(f"{x}.qwc_iq4" for x in (wname, sname, sname + "_d"))[:len(arrays)]
        for name, a in zip(names, arrays):
            model.graph.initializer.append(new_tensor(a, name))
        node.input[1], node.input[2] = names[:2]
        if factors is not None:   # d a super-block in the zero-point input (frontend passes it on)
            while len(node.input) < 4:
                node.input.append("")
            node.input[3] = names[2]
        node.attribute.append(helper.make_attribute(IQ4_ATTR, 1))
        for name in (wname, sname):
            if not any(name in x.input for x in model.graph.node):
                model.graph.initializer.remove(inits.pop(name))
        count += 1
    return count


def compact_xs(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """IQ4_XS's sub-block scales d (ls - 32) [N, K/32] -> ARM's (ws [G, K/128, 48] uint8, wc
    [G, K/256, 16] float16) of kernels/iq4_xs_scales.py, or None where the factors do not come
    back (gguf_blocks.iq4_xs_factors) or K is not whole super-blocks. Rows past N are zeros."""
    from qwc.models.gguf_blocks import iq4_xs_factors

    from .kernels.iq4_xs_scales import QUAD
    from .kernels.row_groups import ROWS, groups, rows_last
    from .repack_q4_k import arm_pairs

    n, nb = scales.shape
    factors = iq4_xs_factors(scales) if nb % (2 * QUAD) == 0 else None
    if factors is None:
        return None
    d, ls = factors
    g = groups(n)
    runs = rows_last(ls, np.uint8).reshape(g, nb // QUAD, QUAD, ROWS)
    # each run's blocks 0, 1 where arm_pairs puts sc0, sc1 and 2, 3 where it puts mn0, mn1
    ws = arm_pairs(runs[:, :, :2].reshape(g, -1, ROWS), runs[:, :, 2:].reshape(g, -1, ROWS))
    return ws, np.ascontiguousarray(rows_last(d, np.float16))
