"""Compile-time half of the per-token activation format (design.md, "Two activation formats").

`qwc optimize --act-scale` records in the graph's metadata which linears take int8
activations with one scale and one zero point a token instead of Q8_0 blocks
(passes/act_scale.py). Here, where the target's prefill GEMM has that form
(targets.IntDots.row_layout), each of those MatMulNBits is marked and given its one extra
input: each weight row's sum of its values, R[n] = sum_b d_b sum_k q_bk. The GEMM computes
sum_b d_b sum_k (a_k - zp) q_bk as sum_b d_b (sum_k a_k q_bk) - zp R[n], so the zero point
costs one multiply-add a row at the store (kernels/arm/i8mm.py, kernels/arm/dotprod.py), not a term a block.

Elsewhere (x86, arm-neon) the choice is left unused: the linears keep their blocks.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc.passes.graph import (
    BLOCK_OFFSETS_ATTR,
    FIVE_BIT_ATTR,
    IQ4_ATTR,
    NIBBLE_HALVES_ATTR,
    Q4_K_SCALES_ATTR,
    Q6_K_ATTR,
    ROW_ACTIVATIONS_ATTR,
    ROW_ACTIVATIONS_KEY,
    Graph,
    has_zero_points,
    matmul_nbits_dims,
    new_tensor,
    tensor_array,
)
from qwc.q4 import unpack_nibbles

from .targets import kernels_for, q4_0_path, q8_0_path

ROW_SUMS_INPUT = 6   # MatMulNBits' inputs: a, codes, scales, zero points, g_idx, bias, then this
_OTHER_FORMS = (BLOCK_OFFSETS_ATTR, FIVE_BIT_ATTR, IQ4_ATTR, NIBBLE_HALVES_ATTR, Q4_K_SCALES_ATTR, Q6_K_ATTR)


def chosen(model: onnx.ModelProto) -> set[str]:
    """The weight names of the linears the graph's metadata chose per-token activations for."""
    value = next((p.value for p in model.metadata_props if p.key == ROW_ACTIVATIONS_KEY), "")
    return {n for n in value.split(",") if n}


def takes_rows(node: onnx.NodeProto, act_bits: int, features) -> bool:
    """Whether this MatMulNBits can take per-token activations on a target with `features`:
    Q4_0 or Q8_0 codes in blocks of 32 without zero points, whole blocks of K, on an
    integer-dot GEMM with the form."""
    if node.op_type != "MatMulNBits" or has_zero_points(node) or any(
            a.name in _OTHER_FORMS and helper.get_attribute_value(a) for a in node.attribute):
        return False
    dots = kernels_for(features).int_dots
    if dots is None or dots.row_layout is None:
        return False
    k, _, block, bits = matmul_nbits_dims(node)
    if block != 32 or k % 32:
        return False
    if bits == 8:
        return q8_0_path(block, bits, act_bits, features) is not None
    return bits == 4 and q4_0_path(block, bits, act_bits, features) == "arm"


def row_sums(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """R [N] float32: sum over blocks of d_b x the block's signed codes' sum, from MatMulNBits'
    plain codes ([N, NB, 16] packed nibbles, q = c - 8; or [N, NB, 32] bytes, q = u - 128) and
    scales ([N x NB] or [N, NB]), in float64 and rounded once."""
    n, nb = codes.shape[0], codes.shape[1]
    # summed with an int64 accumulator, no wider copy of the codes (a 7B down_proj's: 68 MB)
    if bits == 4:
        sums = unpack_nibbles(codes).sum(-1, dtype=np.int64) - 8 * 32
    else:
        sums = codes.sum(-1, dtype=np.int64) - 128 * 32
    d = scales.astype(np.float64).reshape(n, nb)
    return (d * sums).sum(-1).astype(np.float32)


def mark_row_activations(model: onnx.ModelProto, act_bits: int, features) -> int:
    """Mark the chosen linears this target can run so and give each its row sums (before
    repack_weights, from the plain codes); returns how many. A choice naming no linear of the
    graph is an error: the metadata came with another graph."""
    names = chosen(model)
    if not names:
        return 0
    graph = Graph(model)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) > 2]
    unknown = names - {n.input[1] for n in nodes}
    if unknown:
        from qwc.errors import QwcError
        raise QwcError(f"the graph's {ROW_ACTIVATIONS_KEY} names {len(unknown)} linear(s) it does not have "
                       f"(first: {sorted(unknown)[0]}); re-run qwc optimize --act-scale on this graph")
    count = 0
    for node in nodes:
        if node.input[1] not in names or not takes_rows(node, act_bits, features):
            continue
        wname, sname = node.input[1], node.input[2]
        if wname not in graph.inits or sname not in graph.inits:
            continue   # computed weights: the importer says so
        _, _, _, bits = matmul_nbits_dims(node)
        rname = f"{wname}.qwc_row_sums"
        if rname not in graph.inits:
            r = row_sums(tensor_array(graph.inits[wname]), tensor_array(graph.inits[sname]), bits)
            model.graph.initializer.append(new_tensor(r, rname))
            graph.inits[rname] = model.graph.initializer[-1]
        while len(node.input) < ROW_SUMS_INPUT:
            node.input.append("")
        node.input.append(rname)
        node.attribute.append(helper.make_attribute(ROW_ACTIVATIONS_ATTR, 1))
        count += 1
    return count
