"""Fuse RMSNorm into `SimplifiedLayerNormalization`, and a residual Add feeding it into
`SkipSimplifiedLayerNormalization` (com.microsoft), whose 4th output is the residual sum.

Recognised forms (x is the norm input, g the gain):
  dynamo:  Mul(g, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2)), eps)))))
  legacy:  the same with Div(1, Sqrt(...)) instead of Reciprocal, or Div(x, Sqrt(...))
  ONNX 23: RMSNormalization(x, g)
Casts to float32 between the steps (mixed-precision exports) are looked through.
Note: onnxruntime registers SimplifiedLayerNormalization in the default ONNX domain (it
rejects com.microsoft for it), so that is where the fused node goes; the Skip variant is in
com.microsoft.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph import MS_DOMAIN, Graph, ensure_ms_opset
from .options import PassOptions


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    g = Graph(model)
    for n in list(g.g.node):
        if n.op_type == "ReduceMean" and n.domain in ("", "ai.onnx"):
            _fuse_decomposed(g, n)
        elif n.op_type == "RMSNormalization" and n.domain in ("", "ai.onnx"):
            _fuse_onnx23(g, n)
    g.commit()
    ensure_ms_opset(model)
    return model


def _skip_casts(g: Graph, name: str) -> str:
    n = g.producer.get(name)
    while n is not None and n.op_type == "Cast" and g.attr(n, "to") == onnx.TensorProto.FLOAT:
        name = n.input[0]
        n = g.producer.get(name)
    return name


def _next(g: Graph, name: str, op: str) -> onnx.NodeProto | None:
    """The single consumer of `name` (looking through float Casts) if it is `op`."""
    c = g.only_consumer(name)
    while c is not None and c.op_type == "Cast" and g.attr(c, "to") == onnx.TensorProto.FLOAT:
        c = g.only_consumer(c.output[0])
    return c if c is not None and c.op_type == op else None


def _other(n: onnx.NodeProto, name: str) -> str:
    return n.input[1] if n.input[0] == name else n.input[0]


def _reduce_axes(g: Graph, n: onnx.NodeProto) -> list[int] | None:
    if len(n.input) > 1 and n.input[1]:
        v = g.const(n.input[1])
        return None if v is None else [int(a) for a in np.ravel(v)]
    axes = g.attr(n, "axes")
    return None if axes is None else list(axes)


def _fuse_decomposed(g: Graph, rm: onnx.NodeProto) -> None:
    if _reduce_axes(g, rm) != [-1] or g.attr(rm, "keepdims", 1) != 1:
        return
    sq = g.producer.get(rm.input[0])
    if sq is None:
        return
    if sq.op_type == "Pow" and g.scalar(sq.input[1]) == 2.0:
        x = sq.input[0]
    elif sq.op_type == "Mul" and sq.input[0] == sq.input[1]:
        x = sq.input[0]
    else:
        return
    x_src = _skip_casts(g, x)
    add = _next(g, rm.output[0], "Add")
    if add is None:
        return
    eps = g.scalar(_other(add, rm.output[0]))
    sqrt = add and _next(g, add.output[0], "Sqrt")
    if eps is None or sqrt is None:
        return
    inv = g.only_consumer(sqrt.output[0])
    if inv is None:
        return
    if inv.op_type == "Reciprocal" or (inv.op_type == "Div" and inv.input[1] == sqrt.output[0]
                                       and g.scalar(inv.input[0]) == 1.0):
        norm = _next(g, inv.output[0], "Mul")
        if norm is None or _skip_casts(g, _other(norm, inv.output[0])) != x_src:
            return
    elif inv.op_type == "Div" and inv.input[1] == sqrt.output[0] and _skip_casts(g, inv.input[0]) == x_src:
        norm = inv
    else:
        return
    # The gain: a Mul by a 1-D constant right after; absent means a gain of ones.
    gain_mul = _next(g, norm.output[0], "Mul")
    gamma = None
    if gain_mul is not None:
        ins = list(gain_mul.input)
        mine = [i for i in ins if _skip_casts(g, i) == norm.output[0]]
        if len(mine) == 1:
            other = ins[1 - ins.index(mine[0])]
            v = g.const(other)
            if v is not None and v.ndim == 1:
                gamma, out_node = other, gain_mul
    if gamma is None:
        hidden = _hidden_size(g, x_src)
        if hidden is None:
            return
        gamma, out_node = g.add_init(np.ones(hidden, np.float32), "rmsnorm_gamma"), norm
    _emit(g, x_src, gamma, eps, out_node)


def _hidden_size(g: Graph, name: str) -> int | None:
    dims = g.static_dims(name)
    return dims[-1] if dims and dims[-1] else None


def _fuse_onnx23(g: Graph, n: onnx.NodeProto) -> None:
    if g.attr(n, "axis", -1) != -1 or len(n.output) > 1 and any(n.output[1:]):
        return
    _emit(g, n.input[0], n.input[1], float(g.attr(n, "epsilon", 1e-5)), n)


def _emit(g: Graph, x: str, gamma: str, eps: float, out_node: onnx.NodeProto) -> None:
    y = out_node.output[0]
    g.remove_node(out_node)
    res = g.producer.get(x)
    if (res is not None and res.op_type == "Add" and res.domain in ("", "ai.onnx")
            and all(g.const(i) is None for i in res.input) and x not in g.graph_outputs
            and _same_shape(g, res.input[0], res.input[1])):
        total = g.fresh(x + "_sum")
        g.node("SkipSimplifiedLayerNormalization", [res.input[0], res.input[1], gamma],
               [y, "", "", total], domain=MS_DOMAIN, epsilon=eps)
        g.rename_uses(x, total, skip={id(c) for c in g.consumers.get(x, []) if c is res})
    else:
        g.node("SimplifiedLayerNormalization", [x, gamma], [y], axis=-1, epsilon=eps, stash_type=1)


def _same_shape(g: Graph, a: str, b: str) -> bool:
    da, db = g.static_dims(a), g.static_dims(b)
    if da is None or db is None:
        return True  # exported residual adds are same-shaped; ORT checks at run time
    return len(da) == len(db) and da[-1] == db[-1]
