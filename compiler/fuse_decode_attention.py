"""Decode's rotary, cache writes and attention as the one three-pass kernel, and the o
projection's quantizer into it; with Qwen3's QK-norm (a rotary kernel that norms each head
first, frontend.RotaryEmbedding), the norm too.

As imported, one token's attention is five kernels: rotary of q and of k, the K and V cache
writes, and the online attention (kernels/prefill_attention.py: attention). Where the target's rule
picks three-pass decode attention (compiler/targets.py: KERNEL_RULES), this pass replaces
them by decode_attention, which rotates q and k, writes the cache and attends in one launch
(a task per kv head, or per query head on ARM). With `zero_point` (the W4A8 decode GEMVs)
that kernel also writes its output's Q8_0 blocks in the layout the GEMV reads, and the o
projection's quantizer that read the output is replaced by them.

In the verify entry point (compiler/build.py) the same five kernels of t tokens become
decode_attention's `queries` form, and in decode_batch those of a token of each of B
sequences its `rows` form: each token attends as its decode step would, so a speculative
verify call's and a batched step's logits are the decode steps' to the bit, where the online
kernel's rescaling differs by rounding (enough to turn a greedy near tie the other way).

Where it runs: last of the import-time fusions (frontend.import_graph), after
fuse_quantizer_inputs (the o projection's quantizer is then the plain one this pass looks
for). The replaced kernels are left to dead-code elimination.
"""

from __future__ import annotations

from tvm import relax

from .kernels import act_quant, decode_attention, kv_cache, prefill_attention
from .relax_match import Bindings, binding_pass, call_args, call_of, kernel_attr, static_dims


def _rotary_operands(defs: Bindings, rotary_kernels: dict, head_norms: dict, x, heads: int, head_dim: int,
                     lead: list):
    """(x, position_ids, cos, sin, the head norm's gain, its epsilon) when x is a rotary of
    heads x head_dim of `lead` = [rows, tokens] (None: any number) with cos and sin [P,
    head_dim / 2] (the layout decode_attention's own rotary reads), else None; gain and epsilon
    None where the rotary kernel norms no head (frontend.RotaryEmbedding)."""
    e = defs.value(x)
    if not call_of(e, "relax.call_tir") or rotary_kernels.get(e.args[0].name_hint) != heads:
        return None
    args = call_args(e)
    eps = head_norms.get(e.args[0].name_hint)
    gain = None
    if eps is not None:   # (x, gain, position_ids, cos, sin)
        gain = args.pop(1)
    if (static_dims(args[0]) != [*lead, heads * head_dim] or static_dims(args[1]) != lead
            or any(static_dims(t)[1] != head_dim // 2 for t in args[2:])):
        return None
    return [*args, gain, eps]


def _plan(mod, defs: Bindings, rotary_kernels: dict, head_norms: dict, zero_point, layout: str, lead: list):
    """{attention output var: what its fused call needs} for every fusable decode attention,
    and {o projection quantizer var: that attention output var} where zero_point is given."""
    fused, quantizers = {}, {}
    for out, e in defs.values.items():
        scale = kernel_attr(mod, e, prefill_attention.ONLINE_SCALE)
        if scale is None or len(call_args(e)) != 4:   # (not prefill's last query of a chunk)
            continue
        q, kc, vc, seqlens = call_args(e)
        writes = [defs.value(c) for c in (kc, vc)]
        if not all(call_of(w, "relax.call_tir_inplace") for w in writes):
            continue
        (past_k, k, _), (past_v, v, _) = (call_args(w) for w in writes)
        kv_dtype = kv_cache.cache_format(past_k.ty.dtype)
        head_dim, kv_heads = kv_cache.head_dim_of(static_dims(past_k)[3], kv_dtype), static_dims(past_k)[1]
        heads = static_dims(q)[2] // head_dim
        if static_dims(q)[:2] != lead or not decode_attention.fuses_decode_prologue(head_dim):
            continue
        rq = _rotary_operands(defs, rotary_kernels, head_norms, q, heads, head_dim, lead)
        rk = _rotary_operands(defs, rotary_kernels, head_norms, k, kv_heads, head_dim, lead)
        if rq is None or rk is None or not all(a.same_as(b) for a, b in zip(rq[1:4], rk[1:4])) or rq[5] != rk[5]:
            continue
        eps = rq[5]   # Qwen3's QK-norm: both normed with one epsilon, their gains after sin
        inputs = [rq[0], rk[0], v, past_k, past_v, seqlens, *rq[1:4]] + ([] if eps is None else [rq[4], rk[4]])
        if any(defs.order.get(x, -1) > defs.order[kc] for x in inputs):
            continue   # the fused call goes where the K cache write was
        fused[out] = dict(kc=kc, vc=vc, inputs=inputs, q=q, past_k=past_k, past_v=past_v,
                          heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=float(scale), head_norm=eps)
    if zero_point is not None:
        for var, e in defs.values.items():
            mark = kernel_attr(mod, e, act_quant.QUANTIZER)
            # (not a quantizer by super-blocks: a task's head is half of one)
            if (mark is None or mark["kind"] != "plain" or mark["layout"] != layout or act_quant.marked_super_blocks(mark)
                    or int(mark["zero_point"]) != zero_point):
                continue
            src = defs.unreshaped(call_args(e)[0])
            if src not in fused:
                continue
            readers = [v for v, x in defs.values.items() if isinstance(x, relax.TupleGetItem) and x.tuple_value.same_as(var)]
            if len(readers) == defs.uses.get(var, 0):   # read only through its fields
                quantizers[var] = src
    return fused, quantizers


def fuse_decode_attention(kname, rotary_kernels: dict, zero_point: int | None, layout: str = "plain",
                          per_head: bool = False, registers: tuple[int, int] = (16, 32),
                          split_keys: int | None = None, queries: bool = False, rows: bool = False,
                          head_norms: dict | None = None, key_prefetch: int | None = None):
    """The pass; `kname` names a kernel in this entry point, `rotary_kernels` maps the rotary
    kernels the import emitted to their head count and `head_norms` those that norm each head
    to the norm's epsilon (frontend.ImportContext), `zero_point`:
    also write the output's Q8_0 with this zero point (None: do not), in the activation
    `layout` the o projection's GEMV reads; `per_head`: a task per query head, not per kv head;
    `registers`: the target's vector registers (targets.vector_registers); `split_keys`: the
    keys a task takes (targets.Kernels.decode_split_keys); `queries`: the attentions of any
    number of tokens (the verify entry point's), each token's as its decode step's; `rows`: of
    a token of each of B sequences (decode_batch's), each row's as its decode step's (neither
    with zero_point); `key_prefetch`: targets.Kernels.decode_key_prefetch."""
    if (queries or rows) and zero_point is not None:
        raise ValueError("fuse_decode_attention: the queries and rows forms do not write Q8_0 blocks")
    lead = [1, None] if queries else [None, 1] if rows else [1, 1]

    def make(mod, defs: Bindings):
        fused, quantizers = _plan(mod, defs, rotary_kernels, head_norms or {}, zero_point, layout, lead)
        by_write = {f["kc"]: out for out, f in fused.items()}
        by_v_write = {f["vc"]: out for out, f in fused.items()}
        made = {}   # attention output var -> the fused call's (out, K cache, V cache) vars and call

        def rewrite(rw, binding):
            var, e = binding.var, binding.value
            if var in by_write:
                f = fused[by_write[var]]
                quantize = zero_point is not None and by_write[var] in quantizers.values()
                pos = f["inputs"][6]
                kv_dtype = kv_cache.cache_format(f["past_k"].ty.dtype)
                kernel = decode_attention.decode_attention(f["heads"], f["kv_heads"], f["head_dim"], f["scale"],
                                               str(pos.ty.dtype), zero_point if quantize else None, layout,
                                               1 if per_head else None, kv_dtype, registers, split_keys, queries,
                                               rows, head_norm=f["head_norm"], key_prefetch=key_prefetch)
                suffix = ("_queries" if queries else "_rows" if rows else "") + ("_heads" if per_head else "") + ("" if not quantize else "_q8" if layout == "plain"
                                                           else f"_q8_{layout}") + (
                    "" if kv_dtype == "float32" else f"_{kv_dtype}") + ("" if f["head_norm"] is None else "_head_norm")
                gv = rw.builder_.add_func(kernel, kname("attention_3pass" + suffix))
                nb = f["heads"] * f["head_dim"] // act_quant.BLOCK
                q8 = [] if not quantize else [relax.TensorType(shape=[1, nb, act_quant.BLOCK], dtype="int8"),
                                              relax.TensorType(shape=[1, nb], dtype="float32"),
                                              relax.TensorType(shape=[1, nb], dtype="int32")]
                # outputs: out (new), the two caches (in place), the Q8_0 blocks (new)
                call = rw.emit(relax.call_tir_inplace(
                    gv, [rw.var(x) for x in f["inputs"]], [-1, 3, 4] + [-1] * len(q8),
                    [f["q"].ty, f["past_k"].ty, f["past_v"].ty] + q8))
                made[by_write[var]] = [rw.emit(relax.TupleGetItem(call, i)) for i in range(3)] + [call]
                return made[by_write[var]][1]
            if var in by_v_write:
                return made[by_v_write[var]][2]
            if var in fused:
                return made[var][0]
            if var in quantizers:
                return False   # its readers take the attention's blocks below
            if isinstance(e, relax.TupleGetItem) and e.tuple_value in quantizers:
                return rw.emit(relax.TupleGetItem(made[quantizers[e.tuple_value]][3], 3 + e.index))
            return None
        return rewrite

    return binding_pass("qwc.FuseDecodeAttention", make)
