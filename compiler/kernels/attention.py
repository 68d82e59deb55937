"""Attention over the KV-cache buffers with an online softmax (one pass over the keys), and
the writer of the K layout it reads.

K layout ("key tiles"): the K cache buffer [1, kv_heads, cap, head_dim] holds, per kv head,
tiles of KEY_TILE keys stored transposed: element d of key p is at flat offset
(p // 16) * 16 * head_dim + d * 16 + p % 16 within the head. One vector load then gives 16
keys' element d, so a tile's 16 scores are head_dim broadcast FMAs with no horizontal sum per
key (the row layout needed one per key: ~2.5x slower). V keeps the row layout: the value
update is a broadcast FMA per key. cap must be a multiple of 16 (the runtime allocates so).

Prefill (`attention`): one parallel task per (head, query). Query i of a chunk of s new
tokens sits at position past + i (past = seqlens[0] + 1 - s) and attends to cache slots
0 .. past + i: the key loop is bounded by that, not by the buffer's capacity. Running max /
sum / weighted-value accumulator (flash-attention style) updated once per tile, so no score
row is stored; exp is the vector polynomial of kernels/vector_math.py. Decode
(`decode_attention`): one task per kv head, three passes (scores, weights, values).
"""

from __future__ import annotations

import functools

from . import vector_math

KEY_TILE = 16    # keys per tile of the K layout and per online-softmax step
LANES = 16       # fp32 lanes of the value accumulator's vectors
CHAINS = 8       # independent FMA chains per tile's scores (latency, not throughput, bound)
# Decode attention prefetches V rows this far ahead into L2: the streamer restarts at every
# 4 KiB page (16 rows); 32 -> 25 us a layer at 512 cached tokens, cache-cold. Prefetching
# the K tiles too (each one page) changed nothing.
V_PREFETCH_ROWS = 32
NEG_INF = -3.0e38  # the running max's start and masked lanes' score (finite: no inf - inf)
ACCS = 2         # value accumulators (even and odd keys): halves the update's dependency chain


def supports(head_dim: int) -> bool:
    return head_dim % LANES == 0


def k_row_col(pos, d, head_dim):
    """(row, column) in the K buffer's [cap, head_dim] view of key `pos`, element d."""
    o = d * KEY_TILE + pos % KEY_TILE
    return pos // KEY_TILE * KEY_TILE + o // head_dim, o % head_dim


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def kv_cache_write(key_tiles: bool):
    """In-place write of new K (or V) [1, s, kv_heads*head_dim] into the cache buffer
    [1, kv_heads, C, head_dim] at slots past .. past + s - 1, past = seqlens[0] + 1 - s: in
    rows, or (`key_tiles`, K for the fast kernel) in the key-tile layout."""
    from tvm.script import tirx as T

    @T.prim_func(private=True)
    def write(var_cache: T.handle, var_new: T.handle, seqlens: T.Buffer((1,), "int32")):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        kvh, cap, hd, s = T.int64(), T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (T.int64(1), kvh, cap, hd), "float32")
        new = T.match_buffer(var_new, (T.int64(1), s, kvh * hd), "float32")
        past = T.Cast("int64", seqlens[0]) + T.int64(1) - s
        for h in T.serial(kvh):  # a few KiB per layer: a parallel launch would cost more
            for i, d in T.grid(s, hd):
                if key_tiles:
                    row, col = k_row_col(past + i, d, hd)
                    cache[T.int64(0), h, row, col] = new[T.int64(0), i, h * hd + d]
                else:
                    cache[T.int64(0), h, past + i, d] = new[T.int64(0), i, h * hd + d]

    return write


def _tree_sum(xs):
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _tile_scores(T, q, i, kc, h, kvh, t, head_dim):
    """Tile t's 16 unscaled scores of query i's head h against kv head kvh: sum over d of
    q[d] * (16 keys' element d), in CHAINS independent FMA chains."""
    def part(c):
        terms = []
        for d in range(c, head_dim, CHAINS):
            row, col = k_row_col(t * KEY_TILE, d, head_dim)   # t * KEY_TILE: the tile's first key
            terms.append(T.broadcast(q[T.int64(0), i, h * head_dim + d], KEY_TILE)
                         * kc[T.int64(0), kvh, row, T.ramp(col, 1, KEY_TILE)])
        acc = terms[0]
        for x in terms[1:]:
            acc = acc + x
        return acc
    return _tree_sum([part(c) for c in range(CHAINS)])


def _in_tile(T, t, keys):
    """Lanes of tile t that hold one of the first `keys` keys."""
    return T.broadcast(t * KEY_TILE, KEY_TILE) + T.ramp(T.int64(0), T.int64(1), KEY_TILE) < T.broadcast(keys, KEY_TILE)


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    from tvm.script import tirx as T

    group = heads // kv_heads
    chunks = head_dim // LANES
    kt = KEY_TILE

    @T.macro
    def tile(q, kc, vc, acc, stat, p, task, s, keys, t, masked):
        """Keys 16t .. 16t+15 into the running state; `masked`: only those below `keys`."""
        sc = _tile_scores(T, q, task % s, kc, task // s, task // s // group, t, head_dim) * T.broadcast(T.float32(scale), kt)
        if masked:
            sc = T.Select(_in_tile(T, t, keys), sc, T.broadcast(T.float32(NEG_INF), kt))
        scv = T.bind(sc)
        m = T.bind(T.max(stat[0], vector_math.reduce_max(T, scv, kt)))
        r = T.bind(vector_math.exp(T, stat[0] - m, 1))   # rescale of what came before
        p[T.ramp(0, 1, kt)] = vector_math.exp(T, scv - T.broadcast(m, kt), kt)   # masked keys: ~1e-38
        stat[0] = m
        stat[1] = stat[1] * r + vector_math.reduce_sum(T, p[T.ramp(0, 1, kt)], kt)
        for c in range(ACCS * chunks):
            acc[T.ramp(c * LANES, 1, LANES)] = acc[T.ramp(c * LANES, 1, LANES)] * T.broadcast(r, LANES)
        for j in T.unroll(kt):
            if not masked or t * kt + j < keys:
                for c in T.unroll(chunks):
                    acc[T.ramp((j % ACCS * chunks + c) * LANES, 1, LANES)] = acc[T.ramp((j % ACCS * chunks + c) * LANES, 1, LANES)] + vc[
                        T.int64(0), (task // s) // group, t * kt + j, T.ramp(c * LANES, 1, LANES)] * T.broadcast(p[j], LANES)

    @T.prim_func(private=True)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, seqlens: T.Buffer((1,), "int32"),
               var_out: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        s, cap = T.int64(), T.int64()
        q = T.match_buffer(var_q, (T.int64(1), s, heads * head_dim), "float32")
        kc = T.match_buffer(var_k, (T.int64(1), kv_heads, cap, head_dim), "float32")
        vc = T.match_buffer(var_v, (T.int64(1), kv_heads, cap, head_dim), "float32")
        out = T.match_buffer(var_out, (T.int64(1), s, heads * head_dim), "float32")
        assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
        for task in T.parallel(heads * s):
            acc = T.decl_buffer((ACCS * head_dim,), "float32", scope="global")
            stat = T.decl_buffer((2,), "float32", scope="global")   # running max, running sum
            p = T.decl_buffer((kt,), "float32", scope="global")    # the tile's weights
            for c in range(ACCS * chunks):
                acc[T.ramp(c * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
            stat[0] = T.float32(NEG_INF)
            stat[1] = T.float32(0)
            keys = T.bind(T.Cast("int64", seqlens[0]) + T.int64(1) - s + task % s + T.int64(1))
            for t in range(keys // kt):
                tile(q, kc, vc, acc, stat, p, task, s, keys, t, False)
            if keys % kt != 0:
                tile(q, kc, vc, acc, stat, p, task, s, keys, keys // kt, True)
            for c in range(chunks):
                out[T.int64(0), task % s, T.ramp((task // s) * head_dim + c * LANES, 1, LANES)] = (
                    _tree_sum([acc[T.ramp((a * chunks + c) * LANES, 1, LANES)] for a in range(ACCS)])
                    / T.broadcast(stat[1], LANES))

    return kernel


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def decode_attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    """Attention of one new token (decode), one parallel task per kv head running its whole
    group of query heads, in three passes over the cached keys instead of the online update:

    1. scores: each K tile comes from memory once and serves every head of the group from
       L1; the scores go to a row per head (past * 4 bytes) and a running vector max;
    2. exp(score - max) in place and their sum;
    3. values: each V row comes from memory once and updates every head's accumulators.

    No pass carries a dependency from tile to tile but a max or a sum, so the tiles overlap in
    the core, where the online form's per-tile rescale chain (max -> exp -> rescale -> update)
    serialised them: 1.5x faster than `attention` at 512 cached tokens, 1.9x at 3000 (kernel
    harness, cache-cold; docs/design.md). Decode has kv_heads tasks: on many cores, splitting
    the keys across threads would be the next step."""
    from tvm.script import tirx as T

    group = heads // kv_heads
    chunks = head_dim // LANES
    kt = KEY_TILE

    @T.prim_func(private=True)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, seqlens: T.Buffer((1,), "int32"),
               var_out: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        cap = T.int64()
        q = T.match_buffer(var_q, (T.int64(1), T.int64(1), heads * head_dim), "float32")
        kc = T.match_buffer(var_k, (T.int64(1), kv_heads, cap, head_dim), "float32")
        vc = T.match_buffer(var_v, (T.int64(1), kv_heads, cap, head_dim), "float32")
        out = T.match_buffer(var_out, (T.int64(1), T.int64(1), heads * head_dim), "float32")
        assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
        keys = T.Cast("int64", seqlens[0]) + T.int64(1)    # the new token attends to slots 0 .. seqlens[0]
        tiles = (keys + T.int64(kt - 1)) // T.int64(kt)
        for kvh in T.parallel(kv_heads):
            sc = T.alloc_buffer((group, cap), "float32")        # scores, then weights, per head
            mx = T.decl_buffer((group * kt,), "float32", scope="global")   # running max lanes
            tot = T.decl_buffer((group,), "float32", scope="global")       # sum of the weights
            acc = T.decl_buffer((group * head_dim,), "float32", scope="global")
            for hh in range(group):
                mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(NEG_INF), kt)
            for t in range(tiles):          # 1: scores (past the last key: -inf)
                for hh in T.unroll(group):
                    s = T.bind(T.Select(_in_tile(T, t, keys),
                                        _tile_scores(T, q, T.int64(0), kc, kvh * group + hh, kvh, t, head_dim)
                                        * T.broadcast(T.float32(scale), kt), T.broadcast(T.float32(NEG_INF), kt)))
                    sc[hh, T.ramp(t * kt, 1, kt)] = s
                    mx[T.ramp(hh * kt, 1, kt)] = T.max(mx[T.ramp(hh * kt, 1, kt)], s)
            for hh in range(group):         # 2: weights exp(s - max) (past the last key: 0)
                m = T.bind(vector_math.reduce_max(T, mx[T.ramp(hh * kt, 1, kt)], kt))
                mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(0), kt)    # now the sum's lanes
                for t in range(tiles):
                    e = T.bind(T.Select(_in_tile(T, t, keys),
                                        vector_math.exp(T, sc[hh, T.ramp(t * kt, 1, kt)] - T.broadcast(m, kt), kt),
                                        T.broadcast(T.float32(0), kt)))
                    sc[hh, T.ramp(t * kt, 1, kt)] = e
                    mx[T.ramp(hh * kt, 1, kt)] = mx[T.ramp(hh * kt, 1, kt)] + e
                tot[hh] = vector_math.reduce_sum(T, mx[T.ramp(hh * kt, 1, kt)], kt)
                for c in range(chunks):
                    acc[T.ramp((hh * chunks + c) * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
            for j in range(keys):           # 3: values
                for c in range(chunks):     # V rows 32 ahead into L2 (past the buffer: no fault)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                        vc[T.int64(0), kvh, j + V_PREFETCH_ROWS, c * LANES]), T.int32(0), T.int32(2), T.int32(1)))
                for hh in T.unroll(group):
                    for c in T.unroll(chunks):
                        acc[T.ramp((hh * chunks + c) * LANES, 1, LANES)] = acc[T.ramp((hh * chunks + c) * LANES, 1, LANES)] + (
                            vc[T.int64(0), kvh, j, T.ramp(c * LANES, 1, LANES)] * T.broadcast(sc[hh, j], LANES))
            for hh in range(group):
                for c in range(chunks):
                    out[T.int64(0), T.int64(0), T.ramp((kvh * group + hh) * head_dim + c * LANES, 1, LANES)] = (
                        acc[T.ramp((hh * chunks + c) * LANES, 1, LANES)] / T.broadcast(tot[hh], LANES))

    return kernel
