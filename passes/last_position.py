"""The lm_head for the last position only: the rewrite `qwc compile` applies to the prefill
and decode graphs (the `score` entry point keeps every position)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qwc.errors import QwcError


def last_position_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """Compute the lm_head for the last position only: generation needs nothing else, and a
    512-token prompt would otherwise produce 512 x vocab logits (311 MB for Qwen2.5)."""
    g = model.graph
    prod = {o: n for n in g.node for o in n.output}
    head = prod.get("logits")
    if head is None:
        raise QwcError("graph has no 'logits' output")
    x = head.input[0]
    sliced = x + "_last"
    g.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), "qwc_last_start"),
                          numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "qwc_last_end"),
                          numpy_helper.from_array(np.array([1], np.int64), "qwc_seq_axis")])
    node = helper.make_node("Slice", [x, "qwc_last_start", "qwc_last_end", "qwc_seq_axis"], [sliced],
                            name="qwc_last_position")
    idx = list(g.node).index(head)
    g.node.insert(idx, node)
    head.input[0] = sliced
    return model
