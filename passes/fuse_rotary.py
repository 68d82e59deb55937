"""Fuse rotary position embedding into com.microsoft `RotaryEmbedding`.

Matched (x = Transpose[0,2,1,3](Reshape(lin)), the per-head view of a q or k projection):
    Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h:)), Slice(x, :h)), sin))   (either operand order)
Rewritten to Transpose(Reshape(RotaryEmbedding(lin, position_ids, cos_cache, sin_cache))),
reusing the original Reshape's shape, so the attention pass sees the rotated projection in
[batch, seq, heads * head_dim] form.

Qwen3's QK-norm sits between the view and the rotation: x = Transpose(SimplifiedLayerNorm(
Reshape(lin))), the norm over each head that passes/fuse_rmsnorm.py made. The rotation then
takes the normed heads flattened back, Reshape(SimplifiedLayerNorm(...), [0, 0, heads *
head_dim]): the form models/stream_export.py writes, which compile time fuses into the
rotary kernel (compiler/frontend.py: RotaryEmbedding).

The cos/sin caches are initializers of [positions, head_dim / 2] computed from the model
config (rope_theta, YaRN) in float32, the way transformers computes them (qwc/rotary.py).
"""

from __future__ import annotations

import numpy as np
import onnx

from qwc.errors import QwcError
from qwc.rotary import model_rotary_caches

from .graph import MS_DOMAIN, Graph, ensure_ms_opset
from .options import PassOptions


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    cfg = (options or PassOptions()).require_config("the rotary pass (rope_theta, head_dim)")
    g = Graph(model)
    if "position_ids" not in g.graph_inputs:
        raise QwcError("graph has no position_ids input: cannot fuse rotary embedding")
    caches = None
    for n in list(g.g.node):
        if n.op_type != "Add" or n.domain not in ("", "ai.onnx"):
            continue
        m = _match(g, n, cfg.head_dim)
        if m is None:
            continue
        x_t, lin, shape, heads = m
        lin = _flat_head_norm(g, lin, heads, cfg.head_dim)
        if caches is None:
            cos, sin = model_rotary_caches(cfg)
            caches = (g.add_init(cos, "rotary_cos_cache"), g.add_init(sin, "rotary_sin_cache"))
        rot = g.fresh(lin + "_rotary")
        g.node("RotaryEmbedding", [lin, "position_ids", *caches], [rot], domain=MS_DOMAIN,
               interleaved=0, num_heads=heads)
        view = g.fresh(rot + "_heads")
        g.node("Reshape", [rot, shape], [view])
        g.remove_node(n)
        g.node("Transpose", [view], [n.output[0]], perm=[0, 2, 1, 3])
    g.commit()
    ensure_ms_opset(model)
    return model


def _prod(g: Graph, name: str, op: str) -> onnx.NodeProto | None:
    n = g.producer.get(name)
    return n if n is not None and n.op_type == op else None


def _match(g: Graph, add: onnx.NodeProto, head_dim: int):
    a, b = (_prod(g, i, "Mul") for i in add.input)
    if a is None or b is None:
        return None
    for direct, rotated in ((a, b), (b, a)):
        for xi in range(2):
            x = direct.input[xi]
            if _is_rotate_half_of(g, rotated, x):
                return _per_head_view(g, x, head_dim)
    return None


def _is_rotate_half_of(g: Graph, mul: onnx.NodeProto, x: str) -> bool:
    for ci in range(2):
        cat = _prod(g, mul.input[ci], "Concat")
        if cat is None or len(cat.input) != 2 or g.attr(cat, "axis") not in (-1, 3):
            continue
        neg = _prod(g, cat.input[0], "Neg")
        lo = _prod(g, cat.input[1], "Slice")
        hi = neg and _prod(g, neg.input[0], "Slice")
        if lo is None or hi is None or lo.input[0] != x or hi.input[0] != x:
            continue
        return True
    return False


def _per_head_view(g: Graph, x: str, head_dim: int):
    """x == Transpose[0,2,1,3](Reshape(lin, shape)) -> (x, lin, shape, heads); with a
    per-head norm between them, (x, the norm's name, shape, heads)."""
    t = _prod(g, x, "Transpose")
    if t is None or list(g.attr(t, "perm", [])) != [0, 2, 1, 3]:
        return None
    src = t.input[0]
    norm = _prod(g, src, "SimplifiedLayerNormalization")
    r = _prod(g, norm.input[0] if norm is not None else src, "Reshape")
    if r is None:
        return None
    heads = _heads_from_reshape(g, r, head_dim)
    if heads is None:
        return None
    return x, norm.output[0] if norm is not None else r.input[0], r.input[1], heads


def _flat_head_norm(g: Graph, lin: str, heads: int, head_dim: int) -> str:
    """`lin` itself where it is a projection; a per-head norm's output [b, s, heads, head_dim]
    flattened to [b, s, heads * head_dim] for RotaryEmbedding. The view the norm reads gets a
    constant shape (the exporter computes it from Shape ops), so compile time sees the heads
    (compiler/frontend.py: RotaryEmbedding fuses the norm)."""
    norm = _prod(g, lin, "SimplifiedLayerNormalization")
    if norm is None:
        return lin
    view = _prod(g, norm.input[0], "Reshape")
    view.input[1] = g.add_init(np.array([0, 0, heads, head_dim], np.int64), "heads_shape")
    for a in [a for a in view.attribute if a.name == "allowzero"]:   # 0s copy the input's dims
        view.attribute.remove(a)
    flat = g.fresh(lin + "_flat")
    g.node("Reshape", [lin, g.add_init(np.array([0, 0, heads * head_dim], np.int64), "flat_heads_shape")], [flat])
    return flat


def _heads_from_reshape(g: Graph, r: onnx.NodeProto, head_dim: int) -> int | None:
    """The head count of a [b, s, heads, head_dim] view of `lin`: from the projection's
    static width (exports often write the head count as -1 in the shape)."""
    dims = g.static_dims(r.input[0])
    if dims and dims[-1] and dims[-1] % head_dim == 0:
        return dims[-1] // head_dim
    shape = g.const(r.input[1])
    if shape is not None and shape.size == 4 and shape[2] > 0:
        return int(shape[2])
    return None
