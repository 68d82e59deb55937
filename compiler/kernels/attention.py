"""Attention over the KV-cache buffer with an online softmax (one pass over the keys).

One parallel task per (head, query). Query i of a chunk of s new tokens sits at position
past + i (past = seqlens[0] + 1 - s) and attends to cache slots 0 .. past + i: the key loop
is bounded by that, not by the buffer's capacity. Running max / sum / weighted-value
accumulator (flash-attention style) updated once per tile of TILE keys, so no score row is
stored and the tile's dot products and exps are independent of each other; dot products and
the value update are vectorised over head_dim in 8-lane fp32 vectors.
"""

from __future__ import annotations


LANES = 8
TILE = 8    # keys per online-softmax step


def supports(head_dim: int) -> bool:
    return head_dim % LANES == 0


def _tree_sum(xs):
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


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
            acc = T.decl_buffer((head_dim,), "float32", scope="global")
            stat = T.decl_buffer((4,), "float32", scope="global")   # running max, sum, tile max, rescale
            sc = T.decl_buffer((TILE,), "float32", scope="global")  # the tile's scores, then weights
            for c in range(chunks):
                acc[T.ramp(c * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
            stat[0] = T.float32(neg_inf)
            stat[1] = T.float32(0)
            keys = T.Cast("int64", seqlens[0]) + T.int64(1) - s + task % s + T.int64(1)
            for jt in range((keys + TILE - 1) // TILE):
                # Scores of the tile: independent of each other and of the running state.
                # The dot: lane-wise products summed as a balanced tree of vectors, then one
                # horizontal sum (a reduction per chunk made each key 8 ordered sums long).
                for u in T.unroll(TILE):
                    sc[u] = T.if_then_else(jt * TILE + u < keys, T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fadd.v8f32", T.float32(0),
                        _tree_sum([q[T.int64(0), task % s, T.ramp((task // s) * head_dim + c * LANES, 1, LANES)]
                                   * kc[T.int64(0), (task // s) // group, T.min(jt * TILE + u, keys - 1),
                                        T.ramp(c * LANES, 1, LANES)]
                                   for c in range(chunks)])) * T.float32(scale), T.float32(neg_inf))
                stat[2] = stat[0]
                for u in T.unroll(TILE):
                    stat[2] = T.max(stat[2], sc[u])
                # One rescale per tile (not per key): the per-key exp no longer waits on the
                # previous key's running max.
                stat[3] = T.exp(stat[0] - stat[2])
                stat[0] = stat[2]
                stat[1] = stat[1] * stat[3]
                for c in range(chunks):
                    acc[T.ramp(c * LANES, 1, LANES)] = acc[T.ramp(c * LANES, 1, LANES)] * T.broadcast(stat[3], LANES)
                for u in T.unroll(TILE):
                    sc[u] = T.exp(sc[u] - stat[0])   # 0 for the padding past `keys`
                    stat[1] = stat[1] + sc[u]
                for u in range(TILE):
                    if jt * TILE + u < keys:
                        for c in range(chunks):
                            acc[T.ramp(c * LANES, 1, LANES)] = acc[T.ramp(c * LANES, 1, LANES)] + vc[
                                T.int64(0), (task // s) // group, jt * TILE + u, T.ramp(c * LANES, 1, LANES)] * T.broadcast(sc[u], LANES)
            for c in range(chunks):
                out[T.int64(0), task % s, T.ramp((task // s) * head_dim + c * LANES, 1, LANES)] = (
                    acc[T.ramp(c * LANES, 1, LANES)] / T.broadcast(stat[1], LANES))

    return kernel
