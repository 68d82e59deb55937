"""Fold each RMSNorm's gain into the input channels of the linears that read it.

    (x / rms(x) * g) @ W  ==  (x / rms(x)) @ (diag(g) W)

so the norm's gain becomes ones and the multiply disappears into weights that are about to
be quantized anyway. Only with `fold_norm_gains` (`qwc optimize --fold-norm-gains`): before
post-training quantization the fold costs accuracy (PassOptions says how much). A norm is folded only when every reader of its output is a MatMul with a
constant weight (q/k/v after the input norm, gate/up after the post-attention norm).

A tied lm_head reads the final norm through Transpose(embedding): folding the gain into it
would change the embedding too, so that norm keeps its gain unless `untie_lm_head` is set,
which gives the lm_head its own (scaled) copy of the weight — one more vocab x hidden matrix
in the file, traded for one less multiply per token.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import Graph, mark_rescaled_inputs
from .options import PassOptions

_NORMS = {("", "SimplifiedLayerNormalization"): 1, ("com.microsoft", "SkipSimplifiedLayerNormalization"): 2}


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    options = options or PassOptions()
    if not options.fold_norm_gains:   # the default: PassOptions.fold_norm_gains says why
        return model
    g = Graph(model)
    folded = False
    for n in list(g.g.node):
        k = _NORMS.get((n.domain, n.op_type))
        if k is None:
            continue
        gamma = g.const(n.input[k])
        if gamma is None or gamma.ndim != 1 or np.all(gamma == 1):
            continue
        plan = []
        for c in g.consumers.get(n.output[0], []):
            if c.op_type in ("Shape", "Size"):
                continue  # reads only the shape, which folding does not change
            w = g.const(c.input[1]) if c.op_type == "MatMul" and c.input[0] == n.output[0] else None
            if w is not None and w.ndim == 2 and w.shape[0] == gamma.size:
                plan.append((c, w))
                continue
            tied = _tied_lm_head(g, c, n.output[0])
            if tied is not None and options.untie_lm_head:
                plan.append((c, tied))
                continue
            plan = None
            break
        if not plan or n.output[0] in g.graph_outputs:
            continue
        for c, w in plan:
            c.input[1] = g.add_init((gamma[:, None] * w).astype(np.float32), c.input[1] + "_folded")
        n.input[k] = g.add_init(np.ones_like(gamma, dtype=np.float32), n.input[k] + "_ones")
        folded = True
    g.commit()
    if folded:
        mark_rescaled_inputs(model, "fold_norm_gains")
    return model


def _tied_lm_head(g: Graph, c: onnx.NodeProto, y: str) -> np.ndarray | None:
    """For MatMul(y, Transpose(E)) with a constant E, the [K, N] weight E.T."""
    if c.op_type != "MatMul" or c.input[0] != y:
        return None
    t = g.producer.get(c.input[1])
    if t is None or t.op_type != "Transpose" or list(g.attr(t, "perm", [1, 0])) != [1, 0]:
        return None
    e = g.const(t.input[0])
    return None if e is None or e.ndim != 2 else np.ascontiguousarray(e.T)
