"""A GGUF's Q5_1 / Q5_K linears made one node again: the canonical graph holds each as a
MatMulNBits of 8-bit codes (w = d (u - 128), models/gguf_blocks.py) plus a term that adds every
block's minimum m times the block's sum of the input (Reshape -> ReduceSum -> MatMul by the
minimums [K/32, N] -> Add), since onnxruntime takes no float zero points on 8-bit codes.

This fold gives the minimums to the MatMulNBits as its block offsets (graph.BLOCK_OFFSETS_ATTR:
the input the W4A8 / W8A8 kernels read beside the scales, one FMA a block by the activations'
block sum, as Q4_1's c), and removes the term. It runs before the other compile-time
rewrites, so every fusion that finds a linear by its MatMulNBits sees one node; the format
stays in the node's marker (qwc/weight_formats.py) for the manifest.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qwc import weight_formats
from qwc.models.gguf_blocks import minimums_form
from qwc.passes.graph import BLOCK_OFFSETS_ATTR, Graph, matmul_nbits_dims, new_tensor, tensor_array


def fold_block_minimums(model: onnx.ModelProto) -> int:
    """Fold each Q5_1 / Q5_K linear's minimums term into its MatMulNBits; returns the count.
    A term in any other shape than the export writes is left as it is (it still computes the
    same: the generic ops run it)."""
    graph = Graph(model)
    inits, consumers, producer = graph.inits, graph.consumers, graph.producer
    dropped: list[onnx.NodeProto] = []
    count = 0
    for add in list(model.graph.node):
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        found = _parts(add, producer, consumers, inits)
        if found is None:
            continue
        mm, term, sums, blocks = found
        k, n, _, _ = matmul_nbits_dims(mm)
        minimums = tensor_array(inits[term.input[1]]).T   # [K/32, N] -> [N, K/32]
        if minimums.shape != (n, k // 32):
            continue
        name = term.input[1].removesuffix(".T")
        model.graph.initializer.append(new_tensor(np.ascontiguousarray(minimums, np.float32), name))
        bias = mm.input[5] if len(mm.input) > 5 else ""
        del mm.input[3:]
        mm.input.extend([name] + (["", bias] if bias else []))
        mm.attribute.append(helper.make_attribute(BLOCK_OFFSETS_ATTR, 1))
        mm.output[0] = add.output[0]
        dropped += [add, term] + [x for x in (sums, blocks) if len(consumers.get(x.output[0], [])) == 1]
        count += 1
    if dropped:
        ids = {id(x) for x in dropped}
        kept = [x for x in model.graph.node if id(x) not in ids]
        del model.graph.node[:]
        model.graph.node.extend(kept)
        read = {i for x in model.graph.node for i in x.input}
        gone = {i for x in dropped for i in x.input if i in inits and i not in read}
        for t in [t for t in model.graph.initializer if t.name in gone]:
            model.graph.initializer.remove(t)
    return count


def _parts(add, producer, consumers, inits):
    """(MatMulNBits, term MatMul, ReduceSum, Reshape) when `add` adds a Q5_1 / Q5_K linear's
    minimums term to its codes' product, as models/stream_export.py writes them; else None."""
    nodes = [producer.get(i) for i in add.input]
    if any(x is None for x in nodes):
        return None
    mm = next((x for x in nodes if x.op_type == "MatMulNBits"
               and weight_formats.format_of(x).offsets == "minimums"), None)
    term = next((x for x in nodes if x.op_type == "MatMul" and minimums_form(x) == "term"), None)
    if mm is None or term is None or len(consumers.get(mm.output[0], [])) != 1 or term.input[1] not in inits:
        return None
    sums = producer.get(term.input[0])
    blocks = producer.get(sums.input[0]) if sums is not None and sums.op_type == "ReduceSum" else None
    if blocks is None or blocks.op_type != "Reshape" or blocks.input[0] != mm.input[0]:
        return None
    if len(mm.input) > 3 and mm.input[3]:   # zero points as well: not what the export writes
        return None
    return mm, term, sums, blocks
