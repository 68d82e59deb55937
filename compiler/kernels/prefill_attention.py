"""Prefill attention over the KV-cache buffers with an online softmax (one pass over the keys).

One parallel task per block of a head's queries (query_block). Query i of a chunk of s new
tokens sits at position past + i (past = seqlens[0] + 1 - s) and attends to cache slots 0 ..
past + i: the key loop is bounded by that, not by the buffer's capacity. Running max / sum /
weighted-value accumulator (flash-attention style) updated once per span of 64 keys (one query
alone: per tile in its last, partial span), so no score row is stored; the block's queries take
the keys span by span, so a span is read from memory once a block; exp is the vector polynomial
of kernels/vector_math.py. Where the registers hold several queries' state (AVX-512), they take
a span together, its keys widened to float32 once a block, their last spans (the chunk's
diagonal) included, masked at each query's keys.

The macros take their task's buffers as bundles (_Task, _Single, _Groups): the call's tensors
and cache row, and the scratch of the one-query and the query-group paths.

The cache formats and the K layout this reads: kernels/kv_cache.py. Decode's kernel:
kernels/decode_attention.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tvm import tirx

from . import hand_scheduled, vector_math
from .kernel_cache import cached_kernel
from .kv_cache import (
    KEY_TILE,
    LANES,
    NEG_INF,
    Q8,
    STACK_BYTES,
    cache_element,
    cache_width,
    check_dtype,
    in_tile,
    scales_view,
    supports_format,
    widen,
)

# A task takes up to QUERY_BLOCK queries of one head (rounded up to whole groups of
# span_queries), and they take the keys in spans of SPAN in turn: a span's K and V (32 KiB at
# head_dim 64) are read from DRAM or L3 once and from L1 or L2 for the other queries (a task
# per query read every key once per query). A span is also the online softmax's step: one
# rescale and one exp of the running max per 64 keys, and 4 tiles' scores computed side by side.
QUERY_BLOCK = 16
SPAN_TILES = 4
SPAN = SPAN_TILES * KEY_TILE
ONLINE_SCALE = "qwc.attention_scale"    # marks `attention` with its score scale (compiler/fuse_decode_attention.py)
HALF = 8   # float16 lanes of a 128-bit vector: one `fmlal` and one `fmlal2` (half_products)
FMLAL = ("llvm.aarch64.neon.fmlal.v4f32.v8f16", "llvm.aarch64.neon.fmlal2.v4f32.v8f16")


class _Task(NamedTuple):
    """A task's tensors: the call's queries, caches and output, and the task's cache row b and
    head h."""
    q: Any
    kc: Any
    vc: Any
    out: Any
    b: Any
    h: Any


class _Single(NamedTuple):
    """The one-query path's scratch: accumulator, running (max, sum), scores, scaled query, the
    block's running stats, the weights as the values take them (float16 products: p rounded
    to float16; else p itself), whether the products are FEAT_FHM's float16 ones and whether
    the query and weights are rounded to float16 as those are, multiplied in float32 (Python
    bools: half_products)."""
    acc: Any
    stat: Any
    p: Any
    qr: Any
    stats: Any
    pw: Any
    half: bool
    rounds: bool = False


class _Groups(NamedTuple):
    """The query groups' scratch: accumulators, the block's running stats, scores, weights,
    scaled queries, the span widened to float32 (kf, vf; float caches: unused), and whether
    the scaled queries and the weights are rounded to float16 (a Python bool: half_products)."""
    accs: Any
    stats: Any
    ps: Any
    ws: Any
    qrs: Any
    kf: Any
    vf: Any
    rounds: bool = False


def query_block(T, s, block: int = QUERY_BLOCK, groups: bool = False):
    """Queries a prefill task takes for a chunk of s: `block` in long chunks, fewer in short
    ones (s // 16, at least 1), so a 48-token chunk still makes 16 tasks a head for 64-128
    threads. `groups` (query groups, AVX-512): always `block`. A block widens each span once
    for its groups, as much work as a group's pass over it: blocks of 4 at a 64-token chunk
    took longer than blocks of 18 at 128 cached tokens (one layer, 2 threads, Intel Xeon)."""
    if groups:
        return T.int64(block)
    return T.max(T.min(s // 16, T.int64(block)), T.int64(1))


def half_lane(T, buf, i, base=0):
    """float16x8: element base + i of the float16 buffer buf in every lane (i an int, base a
    multiple of 8), the by-element operand of `fmlal` (an 8-lane load and a lane index: no
    broadcast of its own)."""
    return tirx.Shuffle([buf[T.ramp(base + i // HALF * HALF, 1, HALF)]], [i % HALF] * HALF)


def as_half(T, x, lanes: int):
    """float32 x lanes: x rounded to float16, the operand FEAT_FHM's `fmlal` multiplies (the
    product of two float16 values is exact in float32, so an FMA on these gives fmlal's)."""
    return T.Cast(f"float32x{lanes}", T.Cast(f"float16x{lanes}", x))


def half_madd(T, acc, h, b, n: int):
    """acc + h x b: float32 x n acc, float16 x n h (n a multiple of 8), b from half_lane. Arm's
    FEAT_FHM multiplies the float16 pairs exactly into float32 sums (`fmlal` the low 4 lanes
    of each 8, `fmlal2` the high), where widening h first took a `fcvtl` per 4 lanes more."""
    parts = []
    for i in range(n // HALF):
        h8 = tirx.Shuffle([h], list(range(i * HALF, i * HALF + HALF)))
        for k, name in enumerate(FMLAL):
            a4 = tirx.Shuffle([acc], list(range(i * HALF + 4 * k, i * HALF + 4 * k + 4)))
            parts.append(T.call_llvm_pure_intrin("float32x4", name, a4, h8, b))
    return tirx.Shuffle(parts, list(range(n)))


def _tree_sum(xs):
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _tree_max(T, xs):
    while len(xs) > 1:
        xs = [T.max(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def span_queries(head_dim: int, registers: tuple[int, int]) -> int:
    """Queries of a prefill block that take a whole span together (`attention`): as many as
    half the target's vector registers hold the scores and value accumulators of (the other
    half for the span's widened keys and values, loaded once for all of them), and whose
    buffers stay under TVM's stack limit. AVX-512's 32 x 64 B: 3; AVX2's and NEON's files
    hold one query's 16 (AVX2: 8 + 8 halves) and keep the one-query kernel."""
    per_query = max(SPAN, head_dim) * 4
    return max(1, min(registers[0] * registers[1] // 2 // per_query, (STACK_BYTES - 1) // per_query))


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def attention(heads: int, kv_heads: int, head_dim: int, scale: float, batched: bool = False,
              kv_dtype: str = "float32", registers: tuple[int, int] = (16, 32), ragged: bool = False,
              singles: bool = True, half_products: bool = False, last_query: bool = False):
    """`batched`: B sequences (q, out [B, s, ...], caches [B, ...], seqlens [B]), each row
    attending to its own cache row up to its own seqlens[b]; one task per (row, head, query).
    `ragged`: the tokens of G segments one after another (q, out [1, t, ...], caches [B, ...];
    segments [G, 3]: cache row, first token, count; positions [1, t]), each segment's tokens
    attending to its row's cache as a prefill chunk does; a task per (block of a segment's
    queries, head, segment); `singles` False: not the one-token segments (a step's decode
    tokens, which decode_attention's segments form takes). `kv_dtype`: the caches' element
    type (KV_DTYPES). `registers`:
    the target's vector registers (targets.vector_registers), which size the query groups
    (span_queries). A prompt's attention on a float16 cache (a chunk of two or more tokens, not
    `batched`) takes the scaled query and the weights rounded to float16, as llama.cpp's CPU
    attention does, on every target, so that the targets' logits agree:
    `half_products` (the target has Arm's FEAT_FHM; the one-query path) multiplies them and
    the cache's elements as stored into float32 sums (half_madd); elsewhere they are rounded
    (as_half) and multiplied in float32, the same products. A one-token chunk, which a decode
    token is whichever entry point it comes through, attends in float32 as decode does
    (attend_chunk). `last_query`: q and out hold only the last of the chunk's queries (prefill's
    last layer, passes/last_position.py: prefill_nodes), and the kernel takes the chunk's
    length as a scalar argument after seqlens, so that the query attends as it would among them."""
    from tvm.script import tirx as T

    check_dtype(kv_dtype)

    group = heads // kv_heads
    nr = 1 if batched else span_queries(head_dim, registers)   # batched: a task per query
    block = -(-QUERY_BLOCK // nr) * nr   # queries a task: whole groups
    chunks = head_dim // LANES
    kt = KEY_TILE
    # weigh_values' order (chunk by chunk, two an iteration, where the accumulators overflow half the registers)
    by_chunk = chunks % 2 == 0 and chunks * max(1, LANES * 4 // registers[1]) > registers[0] // 2
    q8 = kv_dtype == "q8_0"
    half_operands = not batched and kv_dtype == "float16"   # a prompt's products: float16 operands
    half = half_products and half_operands and nr == 1   # FEAT_FHM's fmlal multiplies them
    width, element = cache_width(kv_dtype, head_dim), cache_element(kv_dtype)
    if not supports_format(kv_dtype, head_dim):
        raise ValueError(f"attention: a {kv_dtype} cache of head_dim {head_dim}")

    def key_elements(ks, ks16, u, d, dtype=kv_dtype):
        """float32x16: element d of the 16 keys of tile u of a span (ks: its keys in `dtype`,
        ks16: their scales' view), q8_0's times their block's scales."""
        w = cache_width(dtype, head_dim)
        k = widen(T, ks[T.ramp(u * kt * w + d * kt, 1, kt)], dtype, kt)
        if dtype == "q8_0":
            k = k * T.Cast("float32x16", ks16[T.ramp((u * kt * w + kt * head_dim) // 2 + d // Q8 * kt, 1, kt)])
        return k

    def value_elements(vs, vs16, j, c, dtype=kv_dtype):
        """float32x16: elements c * 16 .. of the span's value j (q8_0's times their block's scale)."""
        w = cache_width(dtype, head_dim)
        x = widen(T, vs[T.ramp(j * w + c * LANES, 1, LANES)], dtype, LANES)
        if dtype == "q8_0":
            x = x * T.broadcast(T.Cast("float32", vs16[(j * w + head_dim) // 2 + c * LANES // Q8]), LANES)
        return x

    def span_weight(vs16, w, j, c):
        """The span's value j's weight w for its elements from chunk c (q8_0: times their scale)."""
        return w * T.Cast("float32", vs16[(j * width + head_dim) // 2 + c * LANES // Q8]) if q8 else w

    def ramp(at, lanes=LANES):
        return T.ramp(at, 1, lanes)

    def value_term(acc, vs, vs16, p, j, c, fp16, j0=0):
        """acc's chunk c + p[j0 + j] x chunk c of value j0 + j (j an int; j0 a multiple of 16)."""
        if fp16:   # p: the float16 weights
            return half_madd(T, acc[ramp(c * LANES)], vs[ramp((j0 + j) * width + c * LANES)], half_lane(T, p, j, j0),
                             LANES)
        return acc[ramp(c * LANES)] + widen(T, vs[ramp((j0 + j) * width + c * LANES)], kv_dtype, LANES) * T.broadcast(
            span_weight(vs16, p[j0 + j], j0 + j, c), LANES)

    def scaled_query(q, b, qi, h, c, rounds, half=False):
        """Chunk c of query qi of head h times the score scale: float16 with `half` products,
        rounded to float16 where they take float16 operands in float32 (`rounds`)."""
        x = q[b, qi, ramp(h * head_dim + c * LANES)] * T.broadcast(T.float32(scale), LANES)
        if half:
            return T.Cast(f"float16x{LANES}", x)
        return as_half(T, x, LANES) if rounds else x

    @T.macro
    def weigh_values(acc, vs, vs16, p, n, fp16, j0=0, below=None):
        """acc += p[j0 + j] x value j0 + j (vs: the span's values) for j < n, and (`below`) j0 +
        j < below: each element's sum in the order of j either way, value by value where the
        accumulators fit half the registers, else chunk by chunk, two an iteration (head_dim
        128's are NEON's 32 registers: value by value, every FMA loaded and stored its
        accumulator)."""
        if by_chunk:   # decided when the kernel is built
            for c2 in range(chunks // 2):
                for cc in T.unroll(2):
                    for j in T.unroll(n):
                        if below is None or T.Cast("int64", j0 + j) < below:
                            acc[ramp((c2 * 2 + cc) * LANES)] = value_term(acc, vs, vs16, p, j, c2 * 2 + cc, fp16, j0)
        else:
            for j in T.unroll(n):
                if below is None or T.Cast("int64", j0 + j) < below:
                    for c in T.unroll(chunks):
                        acc[ramp(c * LANES)] = value_term(acc, vs, vs16, p, j, c, fp16, j0)

    def span_tiles(p, nt):
        """The span's first nt 16-lane pieces of p (an expression where it is used: bound to a
        name in a macro, TVMScript would copy them to buffers of their own)."""
        return [p[ramp(u * kt, kt)] for u in range(nt)]

    @T.macro
    def span(io, one, qi, t0, keys=None, nt=SPAN_TILES):
        """Keys 16 t0 .. 16 t0 + SPAN - 1 (all below the query's count) into its running state
        with one rescale: the tiles' scores first, then their weights, then the values. Per key
        that is ~25 instructions on AVX2, 17 of them FMAs, where a tile at a time took ~38 with
        spills. With `keys`, the query's last span, keys 16 t0 .. keys - 1 in its first nt
        tiles, as masked_group takes a group's: the tiles' scores, -inf past `keys`, one max,
        the weights (~1e-38 past `keys`: 0 once rounded), the values below `keys`. So the
        running max moves where a query group's does, and the weights rounded to float16 (a
        prompt's float16 operands) are the groups' on every target: tile by tile, each tile's
        rescale rounded other weights."""
        q, kc, vc, out, b, h = T.meta_var((io.q, io.kc, io.vc, io.out, io.b, io.h))
        acc, stat, p, qr, pw = T.meta_var((one.acc, one.stat, one.p, one.qr, one.pw))
        # The span's keys and values through pointers to their first element: every access is
        # that plus a constant, which the loads' addressing takes. Indexed from the caches,
        # LLVM computed ~1000 addresses of a span ahead of the task's loop and spilled them
        # (~2K instructions a task on ARM).
        ks = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        ks16 = scales_view(T, ks, kv_dtype, SPAN * width // 2)   # q8_0's scales
        vs16 = scales_view(T, vs, kv_dtype, SPAN * width // 2)
        for c in T.unroll(chunks):   # the scaled query, where its broadcasts load it from
            qr[ramp(c * LANES)] = scaled_query(q, b, qi, h, c, one.rounds, one.half)
        for u in T.unroll(nt):
            p[ramp(u * kt, kt)] = T.broadcast(T.float32(0), kt)
        for d in T.unroll(head_dim):
            for u in T.unroll(nt):   # key tile u, element d: 16 keys (the K layout)
                if one.half:   # decided when the kernel is built
                    p[ramp(u * kt, kt)] = half_madd(T, p[ramp(u * kt, kt)], ks[ramp(u * kt * width + d * kt, kt)],
                                                    half_lane(T, qr, d), kt)
                else:
                    p[ramp(u * kt, kt)] = p[ramp(u * kt, kt)] + T.broadcast(qr[d], kt) * key_elements(ks, ks16, u, d)
        # with `keys` only the last tile holds keys past them (last_span sizes nt so)
        if keys is not None:   # decided when the kernel is built
            # in_tile's test in int32 lanes (of the tile's keys): half the vectors of int64's on NEON
            p[ramp((nt - 1) * kt, kt)] = T.Select(T.ramp(0, 1, kt) < T.broadcast(T.Cast(
                "int32", keys - (t0 + nt - 1) * kt), kt), p[ramp((nt - 1) * kt, kt)], T.broadcast(T.float32(NEG_INF), kt))
        m = T.bind(T.max(stat[0], vector_math.reduce_max(T, _tree_max(T, span_tiles(p, nt)), kt)))
        r = T.bind(vector_math.exp(T, stat[0] - m, 1))   # rescale of what came before
        for u in T.unroll(nt):   # masked keys: ~1e-38, 0 as float16 and nothing in the sum
            p[ramp(u * kt, kt)] = vector_math.exp(T, p[ramp(u * kt, kt)] - T.broadcast(m, kt), kt)
        stat[0] = m
        stat[1] = stat[1] * r + vector_math.reduce_sum(T, _tree_sum(span_tiles(p, nt)), kt)
        if one.half:   # decided when the kernel is built: the weights the values take
            for u in T.unroll(nt):
                pw[ramp(u * kt, kt)] = T.Cast(f"float16x{kt}", p[ramp(u * kt, kt)])
        if one.rounds:   # decided when the kernel is built (pw is p)
            for u in T.unroll(nt):
                p[ramp(u * kt, kt)] = as_half(T, p[ramp(u * kt, kt)], kt)
        # The query's accumulators (its output row) are read only now, after the scores: held
        # through them, they and the scores' 16 vectors overflowed NEON's 32 registers. They
        # are updated in `acc`, a local buffer LLVM keeps in registers (updated in place in
        # the output, every FMA was followed by a store: the parallel task's pointers do not
        # carry the arguments' noalias).
        for c in T.unroll(chunks):
            acc[ramp(c * LANES)] = out[b, qi, ramp(h * head_dim + c * LANES)] * T.broadcast(r, LANES)
        if keys is None:   # decided when the kernel is built
            weigh_values(acc, vs, vs16, pw, SPAN, one.half)
        else:   # whole tiles, then the last one's keys (past `keys` a value may be unwritten: not read)
            for u in T.unroll(nt - 1):
                weigh_values(acc, vs, vs16, pw, kt, one.half, u * kt)
            weigh_values(acc, vs, vs16, pw, kt, one.half, (nt - 1) * kt, keys - t0 * kt)
        for c in T.unroll(chunks):
            out[b, qi, ramp(h * head_dim + c * LANES)] = acc[ramp(c * LANES)]

    @T.macro
    def last_span(io, one, qi, t0, keys):
        """`span` for the query's last keys, 16 t0 .. keys - 1 (fewer than SPAN): a copy for
        each count of tiles that hold them (K is read in whole tiles, below the capacity)."""
        if keys - t0 * kt > T.int64(3 * kt):
            span(io, one, qi, t0, keys, 4)
        elif keys - t0 * kt > T.int64(2 * kt):
            span(io, one, qi, t0, keys, 3)
        elif keys - t0 * kt > T.int64(kt):
            span(io, one, qi, t0, keys, 2)
        else:
            span(io, one, qi, t0, keys, 1)

    @T.macro
    def widen_span(io, grp, t0, n=None):
        """The span of keys from tile t0 into kf (the K tile layout) and vf (rows) as float32,
        q8_0's scales applied: once for a block, where each of its query groups widened them.
        With `n` (< SPAN), its first n keys: K in whole tiles (a read stays below the capacity,
        a multiple of 16; lanes past the keys are masked where they are scored), the V rows
        below n only (past them a row may be unwritten: NaN times a zero weight)."""
        kc, vc, b, h = T.meta_var((io.kc, io.vc, io.b, io.h))
        kf, vf = T.meta_var((grp.kf, grp.vf))
        ks = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        ks16 = scales_view(T, ks, kv_dtype, SPAN * width // 2)
        vs16 = scales_view(T, vs, kv_dtype, SPAN * width // 2)
        for u in T.unroll(SPAN_TILES) if n is None else T.serial((n + T.int64(kt - 1)) // T.int64(kt)):
            for d in range(head_dim):
                kf[ramp(u * kt * head_dim + d * kt, kt)] = key_elements(ks, ks16, u, d)
        for j in range(SPAN if n is None else n):
            for c in T.unroll(chunks):
                vf[ramp(j * head_dim + c * LANES)] = value_elements(vs, vs16, j, c)

    @T.macro
    def span_group(io, grp, ks, vs, q0, i0):
        """`span` for the nr queries q0 .. q0 + nr - 1 (block entries i0 ..) that all take the
        whole span, its keys ks (the K tile layout) and values vs (rows) in float32: each key
        and value vector is loaded once for the nr queries, their scores and accumulators side
        by side in registers (nr x SPAN_TILES, then nr x chunks vectors)."""
        q, out, b, h = T.meta_var((io.q, io.out, io.b, io.h))
        accs, stats, ps, ws, qrs = T.meta_var((grp.accs, grp.stats, grp.ps, grp.ws, grp.qrs))
        for r in T.unroll(nr):
            for c in T.unroll(chunks):
                qrs[ramp(r * head_dim + c * LANES)] = scaled_query(q, b, q0 + r, h, c, grp.rounds)
            for u in T.unroll(SPAN_TILES):
                ps[ramp(r * SPAN + u * kt, kt)] = T.broadcast(T.float32(0), kt)
        # d in a loop (4 at a time): qrs, indexed by it, stays in memory and its elements are
        # broadcast as they load (unrolled, LLVM held the queries in registers and broadcast
        # each element with a shuffle, on the port the FMAs need); so are the weights below
        for d4 in range(head_dim // 4):
            for d1 in T.unroll(4):
                for u in T.unroll(SPAN_TILES):
                    k = T.bind(key_elements(ks, None, u, d4 * 4 + d1, "float32"))
                    for r in T.unroll(nr):
                        ps[ramp(r * SPAN + u * kt, kt)] = ps[ramp(r * SPAN + u * kt, kt)] + T.broadcast(
                            qrs[r * head_dim + d4 * 4 + d1], kt) * k
        for r in T.unroll(nr):
            pr = [ps[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]
            m = T.bind(T.max(stats[2 * (i0 + r)], vector_math.reduce_max(T, _tree_max(T, pr), kt)))
            rs = T.bind(vector_math.exp(T, stats[2 * (i0 + r)] - m, 1))
            for u in T.unroll(SPAN_TILES):
                ps[ramp(r * SPAN + u * kt, kt)] = vector_math.exp(T, ps[ramp(r * SPAN + u * kt, kt)] - T.broadcast(
                    m, kt), kt)
            stats[2 * (i0 + r)] = m
            stats[2 * (i0 + r) + 1] = stats[2 * (i0 + r) + 1] * rs + vector_math.reduce_sum(T, _tree_sum(
                [ps[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]), kt)
            for c in T.unroll(chunks):
                accs[ramp(r * head_dim + c * LANES)] = out[b, q0 + r, ramp(h * head_dim + c * LANES)] * T.broadcast(
                    rs, LANES)
            for u in T.unroll(SPAN_TILES):
                if grp.rounds:   # decided when the kernel is built
                    ws[ramp(r * SPAN + u * kt, kt)] = as_half(T, ps[ramp(r * SPAN + u * kt, kt)], kt)
                else:
                    ws[ramp(r * SPAN + u * kt, kt)] = ps[ramp(r * SPAN + u * kt, kt)]
        for j4 in range(SPAN // 4):
            for j1 in T.unroll(4):
                for c in T.unroll(chunks):
                    x = T.bind(vs[ramp((j4 * 4 + j1) * head_dim + c * LANES)])
                    for r in T.unroll(nr):
                        accs[ramp(r * head_dim + c * LANES)] = accs[ramp(r * head_dim + c * LANES)] + x * T.broadcast(
                            ws[r * SPAN + j4 * 4 + j1], LANES)
        for r in T.unroll(nr):
            for c in T.unroll(chunks):
                out[b, q0 + r, ramp(h * head_dim + c * LANES)] = accs[ramp(r * head_dim + c * LANES)]

    @T.macro
    def group_scores(ps, qrs, ks, count, nt):
        """Unscaled-query scores of the span's first nt tiles for `count` queries (span_group's loop)."""
        for d4 in range(head_dim // 4):
            for d1 in T.unroll(4):
                for u in T.unroll(nt):
                    k = T.bind(key_elements(ks, None, u, d4 * 4 + d1, "float32"))
                    for r in T.unroll(count):
                        ps[ramp(r * SPAN + u * kt, kt)] = ps[ramp(r * SPAN + u * kt, kt)] + T.broadcast(
                            qrs[r * head_dim + d4 * 4 + d1], kt) * k

    @T.macro
    def masked_group(io, grp, ks, vs, q0, i0, count, n0):
        """span_group for the `count` queries q0 .. (block entries i0 ..) of which query r takes
        the span's first n0 + r keys (n0 >= 1; SPAN or more: all of them): the diagonal of a
        chunk, a group at a time, where a query took its last span alone, tile by tile, each
        with an online rescale (5.4 ns a key against 1.6 in a group's whole span, one layer,
        2 threads, Intel Xeon). Each query gets the same arithmetic in any group and alone
        (count 1), so a prompt's logits do not depend on its chunking, and its whole spans
        span_group's bits:
        - scores of the tiles below the group's last key (the others 0), then -inf past the
          query's own keys;
        - weights exp(score - max), 0 past the query's keys;
        - the values below the group's last key, every query's own past its keys weighed 0 (a
          value past the group's keys may be unwritten: not read)."""
        q, out, b, h = T.meta_var((io.q, io.out, io.b, io.h))
        accs, stats, ps, ws, qrs = T.meta_var((grp.accs, grp.stats, grp.ps, grp.ws, grp.qrs))
        n_last = T.bind(T.min(n0 + T.int64(count - 1), T.int64(SPAN)))   # keys the group reads
        for r in T.unroll(count):
            for c in T.unroll(chunks):
                qrs[ramp(r * head_dim + c * LANES)] = scaled_query(q, b, q0 + r, h, c, grp.rounds)
            for u in T.unroll(SPAN_TILES):
                ps[ramp(r * SPAN + u * kt, kt)] = T.broadcast(T.float32(0), kt)
        if n_last > T.int64(3 * kt):   # the tiles to score: a copy of the loop per count
            group_scores(ps, qrs, ks, count, 4)
        elif n_last > T.int64(2 * kt):
            group_scores(ps, qrs, ks, count, 3)
        elif n_last > T.int64(kt):
            group_scores(ps, qrs, ks, count, 2)
        else:
            group_scores(ps, qrs, ks, count, 1)
        for r in T.unroll(count):
            for u in T.unroll(SPAN_TILES):
                ps[ramp(r * SPAN + u * kt, kt)] = T.Select(in_tile(T, T.int64(u), n0 + T.int64(r)), ps[ramp(
                    r * SPAN + u * kt, kt)], T.broadcast(T.float32(NEG_INF), kt))
            pr = [ps[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]
            m = T.bind(T.max(stats[2 * (i0 + r)], vector_math.reduce_max(T, _tree_max(T, pr), kt)))
            rs = T.bind(vector_math.exp(T, stats[2 * (i0 + r)] - m, 1))
            for u in T.unroll(SPAN_TILES):
                ws[ramp(r * SPAN + u * kt, kt)] = T.Select(
                    in_tile(T, T.int64(u), n0 + T.int64(r)),
                    vector_math.exp(T, ps[ramp(r * SPAN + u * kt, kt)] - T.broadcast(m, kt), kt),
                    T.broadcast(T.float32(0), kt))
            stats[2 * (i0 + r)] = m
            stats[2 * (i0 + r) + 1] = stats[2 * (i0 + r) + 1] * rs + vector_math.reduce_sum(T, _tree_sum(
                [ws[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]), kt)
            for c in T.unroll(chunks):
                accs[ramp(r * head_dim + c * LANES)] = out[b, q0 + r, ramp(h * head_dim + c * LANES)] * T.broadcast(
                    rs, LANES)
            if grp.rounds:   # decided when the kernel is built: the weights the values take, after their sum
                for u in T.unroll(SPAN_TILES):
                    ws[ramp(r * SPAN + u * kt, kt)] = as_half(T, ws[ramp(r * SPAN + u * kt, kt)], kt)
        for j4 in range(n_last // 4):
            for j1 in T.unroll(4):
                for c in T.unroll(chunks):
                    x = T.bind(vs[ramp((j4 * 4 + j1) * head_dim + c * LANES)])
                    for r in T.unroll(count):
                        accs[ramp(r * head_dim + c * LANES)] = accs[ramp(r * head_dim + c * LANES)] + x * T.broadcast(
                            ws[r * SPAN + j4 * 4 + j1], LANES)
        for j in range(n_last // 4 * 4, n_last):
            for c in T.unroll(chunks):
                x = T.bind(vs[ramp(j * head_dim + c * LANES)])
                for r in T.unroll(count):
                    accs[ramp(r * head_dim + c * LANES)] = accs[ramp(r * head_dim + c * LANES)] + x * T.broadcast(
                        ws[r * SPAN + j], LANES)
        for r in T.unroll(count):
            for c in T.unroll(chunks):
                out[b, q0 + r, ramp(h * head_dim + c * LANES)] = accs[ramp(r * head_dim + c * LANES)]

    @T.macro
    def span_group_cache(io, grp, q0, i0, t0):
        """span_group over the span of keys from tile t0, read from float32 caches."""
        kc, vc, b, h = T.meta_var((io.kc, io.vc, io.b, io.h))
        ks = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        span_group(io, grp, ks, vs, q0, i0)

    @T.macro
    def masked_group_cache(io, grp, q0, i0, t0, count, n0):
        """masked_group over the span of keys from tile t0, read from float32 caches."""
        kc, vc, b, h = T.meta_var((io.kc, io.vc, io.b, io.h))
        ks = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        masked_group(io, grp, ks, vs, q0, i0, count, n0)

    @T.macro
    def some_span(io, grp, q0, i0, sp, count, n0):
        """masked_group of the span sp, from the widened span or the float32 caches."""
        if kv_dtype != "float32":
            masked_group(io, grp, grp.kf, grp.vf, q0, i0, count, n0)
        else:
            masked_group_cache(io, grp, q0, i0, sp * SPAN_TILES, count, n0)

    @T.macro
    def one_query(io, one, q0, r, sp, past):
        """Span sp into query q0 + r's running state (stats[2r ..]): the whole span, or its
        keys up to the query's (masked)."""
        stat, stats = T.meta_var((one.stat, one.stats))
        keys = T.bind(past + q0 + r + T.int64(1))
        if sp * SPAN < keys:
            stat[0] = stats[2 * r]
            stat[1] = stats[2 * r + 1]
            if (sp + 1) * SPAN <= keys:
                span(io, one, q0 + r, sp * SPAN_TILES)
            else:   # the query's last span, masked past its keys
                last_span(io, one, q0 + r, sp * SPAN_TILES, keys)
            stats[2 * r] = stat[0]
            stats[2 * r + 1] = stat[1]

    @T.macro
    def attend(q, kc, vc, out, b, h, q0, nq, s, seqlen, fp16=False):
        """Queries q0 .. q0 + nq - 1 (nq <= block) of head h of row b, over that row's keys in
        spans of SPAN: every query of the block takes a span in turn, so the span's K and V
        come from DRAM once and from L1 or L2 for the others. A query's keys are whole spans,
        then tiles (the last one masked). Groups of nr queries take a span below all of
        their keys together (span_group), the others one by one."""
        # The block's accumulators are its output rows (normalised at the end): every buffer
        # of a task then fits TVM's 1 KiB stack limit, where a larger one is a workspace
        # allocation per task (~2.5K instructions a task on ARM).
        stats = T.decl_buffer((block * 2,), "float32", scope="global")   # running max, sum
        acc = T.decl_buffer((head_dim,), "float32", scope="global")   # the query in turn: registers
        stat = T.decl_buffer((2,), "float32", scope="global")
        p = T.decl_buffer((SPAN,), "float32", scope="global")    # scores, then weights
        qr = T.decl_buffer((head_dim,), "float16" if fp16 and half else "float32", scope="global")
        # the weights the values take: float16 with half products, else the scores' buffer
        pw = T.decl_buffer((SPAN,), "float16", scope="global") if fp16 and half else p
        io = T.meta_var(_Task(q, kc, vc, out, b, h))
        for r in T.unroll(block):   # all of them: TVM sizes the buffer by what is written
            stats[2 * r] = T.float32(NEG_INF)
            stats[2 * r + 1] = T.float32(0)
        for r in range(nq):
            for c in range(chunks):
                out[b, q0 + r, ramp(h * head_dim + c * LANES)] = T.broadcast(T.float32(0), LANES)
        past = T.bind(T.Cast("int64", seqlen) + T.int64(1) - s)   # the chunk's first position
        last = T.bind(past + q0 + nq)   # keys the block's last query attends to
        if nr == 1:   # the one-query kernel as it was (AVX2, NEON)
            for sp in range((last + SPAN - 1) // SPAN):
                for r in range(nq):
                    one_query(io, _Single(acc, stat, p, qr, stats, pw, fp16 and half, fp16 and not half), q0, r, sp, past)
        else:
            accs = T.decl_buffer((nr * head_dim,), "float32", scope="global")   # a group's: registers
            ps = T.decl_buffer((nr * SPAN,), "float32", scope="global")
            ws = T.decl_buffer((nr * SPAN,), "float32", scope="global")
            qrs = T.decl_buffer((nr * head_dim,), "float32", scope="global")
            # the block's spans widened once (16 KiB each: workspace); the float32 caches read as they are
            kf = T.decl_buffer((SPAN * head_dim if kv_dtype != "float32" else 1,), "float32", scope="global")
            vf = T.decl_buffer((SPAN * head_dim if kv_dtype != "float32" else 1,), "float32", scope="global")
            grp = T.meta_var(_Groups(accs, stats, ps, ws, qrs, kf, vf, fp16))
            for sp in range((last + SPAN - 1) // SPAN):
                if kv_dtype != "float32":   # the keys the block's last query reaches
                    if (sp + 1) * SPAN <= last:
                        widen_span(io, grp, sp * SPAN_TILES)
                    else:
                        widen_span(io, grp, sp * SPAN_TILES, last - sp * SPAN)
                for g in range((nq + nr - 1) // nr):
                    # its first query has the fewest keys: n0 of the span's (SPAN or more: all)
                    n0 = T.bind(past + q0 + g * nr + T.int64(1) - sp * SPAN)
                    if g * nr + nr <= nq and n0 >= T.int64(SPAN):
                        if kv_dtype != "float32":
                            span_group(io, grp, kf, vf, q0 + g * nr, g * nr)
                        else:
                            span_group_cache(io, grp, q0 + g * nr, g * nr, sp * SPAN_TILES)
                    elif g * nr + nr <= nq and n0 >= T.int64(1):   # the diagonal: every query reaches in
                        some_span(io, grp, q0 + g * nr, g * nr, sp, nr, n0)
                    else:   # a ragged last group, or one whose first queries end before the span
                        for r in range(g * nr, T.min(g * nr + nr, nq)):
                            if past + q0 + r + T.int64(1) > sp * SPAN:
                                some_span(io, grp, q0 + r, r, sp, 1, past + q0 + r + T.int64(1) - sp * SPAN)
        for r in range(nq):
            for c in range(chunks):
                out[b, q0 + r, ramp(h * head_dim + c * LANES)] = (
                    out[b, q0 + r, ramp(h * head_dim + c * LANES)] / T.broadcast(stats[2 * r + 1], LANES))

    if batched:
        @T.prim_func(private=True)
        def kernel_batch(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_seqlens: T.handle,
                         var_out: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8})
            bsz, s, cap = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(var_q, (bsz, s, heads * head_dim), "float32")
            kc = T.match_buffer(var_k, (bsz, kv_heads, cap, width), element)
            vc = T.match_buffer(var_v, (bsz, kv_heads, cap, width), element)
            seqlens = T.match_buffer(var_seqlens, (bsz,), "int32")
            out = T.match_buffer(var_out, (bsz, s, heads * head_dim), "float32")
            assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
            for bt in T.parallel(bsz * heads * s):   # a task per query: a decode step's s is 1
                attend(q, kc, vc, out, bt // (heads * s), bt % (heads * s) // s, bt % s, T.int64(1), s,
                       seqlens[bt // (heads * s)])
        return hand_scheduled(kernel_batch.with_attr(ONLINE_SCALE, float(scale)))

    @T.macro
    def attend_chunk(q, kc, vc, out, b, h, q0, nq, s, seqlen, chunk):
        """`attend` for s queries of a chunk of `chunk` tokens (s, or 1 for its last query):
        float16 products where the kernel takes them and the chunk has two or more (a
        prompt's); a one-token chunk, which a decode token is whichever entry point it comes
        through, attends in float32 as decode does."""
        if half_operands:   # decided when the kernel is built
            if chunk >= T.int64(2):
                attend(q, kc, vc, out, b, h, q0, nq, s, seqlen, True)
            else:
                attend(q, kc, vc, out, b, h, q0, nq, s, seqlen, False)
        else:
            attend(q, kc, vc, out, b, h, q0, nq, s, seqlen, False)

    @T.macro
    def segment_block(call, seg, pos, t, cap, sg, hh, q0, qb):
        """`ragged`'s task: the block of segment sg's queries from q0, head hh (if it has one);
        call: the kernel's (q, kc, vc, out)."""
        q, kc, vc, out = T.meta_var(call)
        if q0 < seg[sg, 2] and seg[sg, 2] >= T.int64(1 if singles else 2):
            # the segment's tokens and cache row as a one-sequence chunk's buffers
            first, n = T.bind(seg[sg, 1]), T.bind(seg[sg, 2])
            qs = T.decl_buffer((T.int64(1), t, heads * head_dim), "float32", data=T.bind(T.address_of(q[0, first, 0])))
            outs = T.decl_buffer((T.int64(1), t, heads * head_dim), "float32",
                                 data=T.bind(T.address_of(out[0, first, 0])))
            kr = T.decl_buffer((T.int64(1), kv_heads, cap, width), element,
                               data=T.bind(T.address_of(kc[seg[sg, 0], 0, 0, 0])))
            vr = T.decl_buffer((T.int64(1), kv_heads, cap, width), element,
                               data=T.bind(T.address_of(vc[seg[sg, 0], 0, 0, 0])))
            attend_chunk(qs, kr, vr, outs, T.int64(0), hh, q0, T.min(qb, n - q0), n, pos[0, first + n - 1], n)

    if ragged:
        @T.prim_func(private=True)
        def kernel_ragged(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_seg: T.handle,
                          var_pos: T.handle, var_out: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8})
            bsz, t, g, cap = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(var_q, (T.int64(1), t, heads * head_dim), "float32")
            kc = T.match_buffer(var_k, (bsz, kv_heads, cap, width), element)
            vc = T.match_buffer(var_v, (bsz, kv_heads, cap, width), element)
            seg = T.match_buffer(var_seg, (g, T.int64(3)), "int64")
            pos = T.match_buffer(var_pos, (T.int64(1), t), "int64")
            out = T.match_buffer(var_out, (T.int64(1), t, heads * head_dim), "float32")
            assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
            # blocks of prefill's size for a chunk of all t tokens (many tasks for many threads);
            # the most blocks a segment can have
            qb = T.bind(query_block(T, t, block, nr > 1))
            blocks = T.bind((t + qb - 1) // qb)
            if nr > 1:
                # a task per head and block (head-major, as `kernel`), each over the segments in
                # turn: query groups' blocks are whole, so a task per segment too would make
                # mostly empty tasks (a short chunk beside a few decode tokens: one in eight
                # with work), each of which still costs a launch's share
                for task in T.parallel(heads * blocks):
                    for sg in range(g):
                        segment_block((q, kc, vc, out), seg, pos, t, cap, sg, task // blocks, task % blocks * qb, qb)
            else:
                # block, then head, then segment: a long segment's tasks are every g-th, spread
                # evenly over the threads' static ranges (segment-major put its heads' tasks in
                # a few threads' ranges, and the critical path at 64 threads grew past the
                # separate calls')
                for task in T.parallel(blocks * heads * g):
                    segment_block((q, kc, vc, out), seg, pos, t, cap, task % g, task // g % heads,
                                  task // (g * heads) * qb, qb)
        return hand_scheduled(kernel_ragged.with_attr(ONLINE_SCALE, float(scale)))

    @T.macro
    def chunk_tasks(q, kc, vc, out, seqlens, s, chunk):
        qb = T.bind(query_block(T, s, block, nr > 1))
        blocks = T.bind((s + qb - 1) // qb)
        # a task per block of a head's queries, head-major: a thread's run of tasks shares K and V
        for task in T.parallel(heads * blocks):
            attend_chunk(q, kc, vc, out, T.int64(0), task // blocks, task % blocks * qb,
                         T.min(qb, s - task % blocks * qb), s, seqlens[0], chunk)

    if last_query:
        @T.prim_func(private=True)
        def kernel_last(var_q: T.handle, var_k: T.handle, var_v: T.handle, seqlens: T.Buffer((1,), "int32"),
                        chunk: T.int64, var_out: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8})
            cap = T.int64()
            q = T.match_buffer(var_q, (T.int64(1), T.int64(1), heads * head_dim), "float32")
            kc = T.match_buffer(var_k, (T.int64(1), kv_heads, cap, width), element)
            vc = T.match_buffer(var_v, (T.int64(1), kv_heads, cap, width), element)
            out = T.match_buffer(var_out, (T.int64(1), T.int64(1), heads * head_dim), "float32")
            assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
            chunk_tasks(q, kc, vc, out, seqlens, T.int64(1), chunk)
        return hand_scheduled(kernel_last.with_attr(ONLINE_SCALE, float(scale)))

    @T.prim_func(private=True)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, seqlens: T.Buffer((1,), "int32"),
               var_out: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        s, cap = T.int64(), T.int64()
        q = T.match_buffer(var_q, (T.int64(1), s, heads * head_dim), "float32")
        kc = T.match_buffer(var_k, (T.int64(1), kv_heads, cap, width), element)
        vc = T.match_buffer(var_v, (T.int64(1), kv_heads, cap, width), element)
        out = T.match_buffer(var_out, (T.int64(1), s, heads * head_dim), "float32")
        assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
        chunk_tasks(q, kc, vc, out, seqlens, s, s)

    return hand_scheduled(kernel.with_attr(ONLINE_SCALE, float(scale)))
