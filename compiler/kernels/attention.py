"""Attention over the KV-cache buffer with an online softmax (one pass over the keys).

One parallel task per (head, query). Query i of a chunk of s new tokens sits at position
past + i (past = seqlens[0] + 1 - s) and attends to cache slots 0 .. past + i: the key loop
is bounded by that, not by the buffer's capacity. Running max / sum / weighted-value
accumulator (flash-attention style), so no score row is stored; dot products and the value
update are vectorised over head_dim in 8-lane fp32 vectors.
"""

from __future__ import annotations


LANES = 8


def supports(head_dim: int) -> bool:
    return head_dim % LANES == 0


def attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    from tvm.script import tirx as T

    group = heads // kv_heads
    chunks = head_dim // LANES
    neg_inf = -3.0e38

    @T.prim_func(private=True)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, seqlens: T.Buffer((1,), "int32"),
               var_out: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        s, cap = T.int64(), T.int64()
        q = T.match_buffer(var_q, (T.int64(1), s, heads * head_dim), "float32")
        kc = T.match_buffer(var_k, (T.int64(1), kv_heads, cap, head_dim), "float32")
        vc = T.match_buffer(var_v, (T.int64(1), kv_heads, cap, head_dim), "float32")
        out = T.match_buffer(var_out, (T.int64(1), s, heads * head_dim), "float32")
        for task in T.parallel(heads * s):
            acc = T.decl_buffer((head_dim,), "float32", scope="local")
            stat = T.decl_buffer((4,), "float32", scope="local")   # running max, sum, score, exp
            for c in range(chunks):
                acc[T.ramp(c * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
            stat[0] = T.float32(neg_inf)
            stat[1] = T.float32(0)
            for j in range(T.Cast("int64", seqlens[0]) + T.int64(1) - s + task % s + T.int64(1)):
                stat[2] = T.float32(0)
                for c in range(chunks):
                    stat[2] = stat[2] + T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v8f32", T.float32(0),
                        q[T.int64(0), task % s, T.ramp((task // s) * head_dim + c * LANES, 1, LANES)]
                        * kc[T.int64(0), (task // s) // group, j, T.ramp(c * LANES, 1, LANES)])
                stat[2] = stat[2] * T.float32(scale)
                # One exp per key: e = exp(-|x - m|). A new max (x > m) rescales what was
                # accumulated by e and weighs this key 1; otherwise the key weighs e.
                stat[3] = T.exp(T.float32(0) - T.abs(stat[2] - stat[0]))
                for c in range(chunks):
                    acc[T.ramp(c * LANES, 1, LANES)] = (
                        acc[T.ramp(c * LANES, 1, LANES)]
                        * T.broadcast(T.if_then_else(stat[2] > stat[0], stat[3], T.float32(1)), LANES)
                        + vc[T.int64(0), (task // s) // group, j, T.ramp(c * LANES, 1, LANES)]
                        * T.broadcast(T.if_then_else(stat[2] > stat[0], T.float32(1), stat[3]), LANES))
                stat[1] = (stat[1] * T.if_then_else(stat[2] > stat[0], stat[3], T.float32(1))
                           + T.if_then_else(stat[2] > stat[0], T.float32(1), stat[3]))
                stat[0] = T.max(stat[0], stat[2])
            for c in range(chunks):
                out[T.int64(0), task % s, T.ramp((task // s) * head_dim + c * LANES, 1, LANES)] = (
                    acc[T.ramp(c * LANES, 1, LANES)] / T.broadcast(stat[1], LANES))

    return kernel
