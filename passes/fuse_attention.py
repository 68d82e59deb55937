"""Fuse attention with its KV cache into com.microsoft `GroupQueryAttention`.

Per layer, the exported graph concatenates the past cache with the new K/V
(present.i.key = Concat(past_key_values.i.key, k)), repeats KV heads for GQA, builds a
causal/padding mask, and computes softmax(q k^T * scale + mask) v. All of it becomes

    out, present.i.key, present.i.value = GroupQueryAttention(
        q, k, v, past_key_values.i.key, past_key_values.i.value, seqlens_k, total_seq_len)

with q, k, v in [batch, seq, heads * head_dim] form (the rotary pass has already produced
them). The cache is a preallocated buffer [batch, kv_heads, cache_len, head_dim] that the op
writes in place (onnxruntime's past_present_share_buffer when past and present are bound to
the same memory). seqlens_k = sum(attention_mask, 1) - 1 and total_seq_len =
attention_mask.shape[1], so attention_mask stays the graph's input and must be right-padded
(ones for every valid position, as generation produces); left padding is not supported.

Matching walks from each Softmax: back through the mask Add and the scale to MatMul(q, k^T),
whose k side reaches present.i.key through the GQA head repeat (Unsqueeze / Expand / Reshape /
Transpose); forward to MatMul(probs, v) whose v side reaches present.i.value, then
Transpose[0,2,1,3] and Reshape back to [batch, seq, hidden].
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto

from qwc.errors import QwcError

from .graph import MS_DOMAIN, Graph, ensure_ms_opset
from .options import PassOptions

_VIEW_OPS = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Cast", "Identity"}


def run(model: onnx.ModelProto, options: PassOptions | None = None) -> onnx.ModelProto:
    cfg = (options or PassOptions()).require_config("the attention pass (heads, KV heads)")
    g = Graph(model)
    if "attention_mask" not in g.graph_inputs:
        raise QwcError("graph has no attention_mask input: cannot fuse attention")
    presents = _present_producers(g)
    lengths = None
    fused = 0
    for sm in list(g.g.node):
        if sm.op_type != "Softmax":
            continue
        m = _match(g, sm, presents)
        if m is None:
            continue
        layer, q, k, v, scale, out = m
        if lengths is None:
            lengths = _lengths(g)
        expected = 1.0 / math.sqrt(cfg.head_dim)
        attrs = dict(num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads)
        if not math.isclose(scale, expected, rel_tol=1e-6):
            attrs["scale"] = float(scale)
        kname, vname = f"present.{layer}.key", f"present.{layer}.value"
        g.remove_node(presents[kname])
        g.remove_node(presents[vname])
        attn = g.fresh(f"attention_{layer}")
        g.node("GroupQueryAttention",
               [q, k, v, f"past_key_values.{layer}.key", f"past_key_values.{layer}.value", *lengths],
               [attn, kname, vname], domain=MS_DOMAIN, **attrs)
        g.rename_uses(out, attn)
        fused += 1
    if fused:
        _rename_cache_dims(g)
    g.commit()
    ensure_ms_opset(model)
    return model


def _present_producers(g: Graph) -> dict[str, onnx.NodeProto]:
    out = {}
    for name in g.graph_outputs:
        if name.startswith("present."):
            n = g.producer.get(name)
            if n is not None and n.op_type == "Concat" and len(n.input) == 2:
                out[name] = n
    return out


def _lengths(g: Graph) -> list[str]:
    """seqlens_k [batch] int32 and total_sequence_length [1] int32 from attention_mask."""
    one = g.add_init(__import__("numpy").array([1], "int64"), "axis_one")
    total = g.fresh("mask_sum")
    g.node("ReduceSum", ["attention_mask", one], [total], keepdims=0)
    minus = g.fresh("seqlens_k_i64")
    g.node("Sub", [total, g.add_init(__import__("numpy").array(1, "int64"), "one")], [minus])
    seqlens = g.fresh("seqlens_k")
    g.node("Cast", [minus], [seqlens], to=TensorProto.INT32)
    shape = g.fresh("total_seq_len_i64")
    g.node("Shape", ["attention_mask"], [shape], start=1, end=2)
    tot = g.fresh("total_seq_len")
    g.node("Cast", [shape], [tot], to=TensorProto.INT32)
    return [seqlens, tot]


def _through_views(g: Graph, name: str, scale: list[float], views=_VIEW_OPS) -> str:
    """Walk back through shape-only ops and constant scalings, collecting the scale."""
    while True:
        n = g.producer.get(name)
        if n is None:
            return name
        if n.op_type in views:
            name = n.input[0]
            continue
        if n.op_type in ("Mul", "Div"):
            c = g.scalar(n.input[1])
            if c is None and n.op_type == "Mul":
                c = g.scalar(n.input[0])
                if c is not None:
                    scale[0] *= c
                    name = n.input[1]
                    continue
            if c is not None:
                scale[0] *= c if n.op_type == "Mul" else 1.0 / c
                name = n.input[0]
                continue
        return name


def _kv_source(g: Graph, name: str, presents) -> str | None:
    """present.i.key / .value reached from `name` through views, or None."""
    src = _through_views(g, name, [1.0])
    return src if src in presents else None


def _match(g: Graph, sm: onnx.NodeProto, presents):
    if g.attr(sm, "axis", -1) not in (-1, 3):
        return None
    # Back: [Add(mask)] -> [scale] -> MatMul(q, k^T)
    scale = [1.0]
    name = sm.input[0]
    n = g.producer.get(name)
    if n is not None and n.op_type == "Add":
        mm_side = [i for i in n.input if _reaches_matmul(g, i)]
        if len(mm_side) != 1:
            return None
        name = mm_side[0]
    name = _through_views(g, name, scale)
    qk = g.producer.get(name)
    if qk is None or qk.op_type != "MatMul":
        return None
    kname = _kv_source(g, qk.input[1], presents)
    if kname is None or not kname.endswith(".key"):
        return None
    q_view = _through_views(g, qk.input[0], scale, views={"Cast", "Identity"})
    q = _projection(g, q_view)
    layer = kname.split(".")[1]
    vname = f"present.{layer}.value"
    if q is None or vname not in presents:
        return None
    k = _projection(g, presents[kname].input[1])
    v = _projection(g, presents[vname].input[1])
    if k is None or v is None or presents[kname].input[0] != f"past_key_values.{layer}.key" \
            or presents[vname].input[0] != f"past_key_values.{layer}.value":
        return None
    # Forward: Softmax -> (Casts) -> MatMul(p, v) -> Transpose[0,2,1,3] -> Reshape
    p = sm.output[0]
    c = g.only_consumer(p)
    while c is not None and c.op_type == "Cast":
        p, c = c.output[0], g.only_consumer(c.output[0])
    if c is None or c.op_type != "MatMul" or c.input[0] != p or _kv_source(g, c.input[1], presents) != vname:
        return None
    t = g.only_consumer(c.output[0])
    if t is None or t.op_type != "Transpose" or list(g.attr(t, "perm", [])) != [0, 2, 1, 3]:
        return None
    r = g.only_consumer(t.output[0])
    if r is None or r.op_type != "Reshape":
        return None
    return layer, q, k, v, scale[0], r.output[0]


def _reaches_matmul(g: Graph, name: str) -> bool:
    n = g.producer.get(_through_views(g, name, [1.0]))
    return n is not None and n.op_type == "MatMul"


def _projection(g: Graph, name: str) -> str | None:
    """[b, s, h*d] tensor behind a per-head view Transpose[0,2,1,3](Reshape(x))."""
    t = g.producer.get(name)
    if t is None or t.op_type != "Transpose" or list(g.attr(t, "perm", [])) != [0, 2, 1, 3]:
        return None
    r = g.producer.get(t.input[0])
    if r is None or r.op_type != "Reshape":
        return None
    return r.input[0]


def _rename_cache_dims(g: Graph) -> None:
    """The cache is now a buffer: its length is the buffer's, not past + seq."""
    for vi in list(g.g.input) + list(g.g.output):
        if vi.name.startswith(("past_key_values.", "present.")):
            dim = vi.type.tensor_type.shape.dim[2]
            dim.Clear()
            dim.dim_param = "cache_len" if vi.name.startswith("past") else "present_len"
