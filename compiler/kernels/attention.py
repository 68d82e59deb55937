"""Attention over the KV-cache buffers with an online softmax (one pass over the keys), and
the writer of the K layout it reads.

K layout ("key tiles"): the K cache buffer [1, kv_heads, cap, head_dim] holds, per kv head,
tiles of KEY_TILE keys stored transposed: element d of key p is at flat offset
(p // 16) * 16 * head_dim + d * 16 + p % 16 within the head. One vector load then gives 16
keys' element d, so a tile's 16 scores are head_dim broadcast FMAs with no horizontal sum per
key (the row layout needed one per key: ~2.5x slower). V keeps the row layout: the value
update is a broadcast FMA per key. cap must be a multiple of 16 (the runtime allocates so).

Prefill (`attention`): one parallel task per block of a head's queries (query_block). Query i
of a chunk of s new tokens sits at position past + i (past = seqlens[0] + 1 - s) and attends
to cache slots 0 .. past + i: the key loop is bounded by that, not by the buffer's capacity.
Running max / sum / weighted-value accumulator (flash-attention style) updated once per span
of 64 keys (one query alone: per tile in its last, partial span), so no score row is stored; the
block's queries take the keys span by span, so a span is read from memory once a block; exp
is the vector polynomial of kernels/vector_math.py. Where the registers hold several queries'
state (AVX-512), they take a span together, its keys widened to float32 once a block, their
last spans (the chunk's diagonal) included, masked at each query's keys.
Decode (`decode_attention`): a task per kv head (x86) or per query head (ARM), three passes
(scores, weights, values); on ARM, at depth, the keys split in spans over tasks as well,
merged after.
"""

from __future__ import annotations

import functools

from . import hand_scheduled, vector_math

KEY_TILE = 16    # keys per tile of the K layout and per online-softmax step
LANES = 16       # fp32 lanes of the value accumulator's vectors
CHAINS = 8       # independent FMA chains per tile's scores (latency, not throughput, bound)
# Decode attention reads each K tile and V row once, from DRAM, at what one core can pull
# (13-16 GB/s): its passes are reads. So the scores keep several streams in flight, each with
# a software prefetch 1 KiB ahead into L1 (a tile of keys is one 4 KiB page, where the
# hardware streamer restarts), which shortened the scores pass in cycle stamps (docs/design.md);
# 8 or 32 lines ahead were no faster. The values pass reads V a block at a time, the next block
# prefetched while the first tile of this one runs (two blocks ahead, or none, were slower).
SCORE_STREAMS = 2        # K tiles scored at once (if their accumulators fit the registers)
K_PREFETCH_LINES = 16    # 1 KiB ahead in each K stream
V_BLOCK = 64             # keys a block of the values pass (8 KiB of f16 V at head_dim 64: in L1)
# TVM serves a constant-size buffer under 1 KiB from the stack, where LLVM keeps it in
# registers; a larger one from its workspace pool, which LLVM cannot tell apart from the other
# buffers, so every update of it is stored (the values pass was bound by those stores).
STACK_BYTES = 1024
NEG_INF = -3.0e38  # the running max's start and masked lanes' score (finite: no inf - inf)
# Prefill: a task takes up to QUERY_BLOCK queries of one head (rounded up to whole groups of
# span_queries: 18 on AVX-512), and they take the keys in spans of SPAN in turn: a span's K
# and V (32 KiB at head_dim 64) are read from DRAM or L3 once and from L1 or L2 for the other
# queries (a task per query read every key once per query: 2 MiB a query at 4k cached
# tokens). A span is also the online softmax's step: one rescale and one exp of the running
# max per 64 keys, and 4 tiles' scores computed side by side.
QUERY_BLOCK = 16
SPAN_TILES = 4
SPAN = SPAN_TILES * KEY_TILE
WRITES_Q8 = "qwc.decode_attention_q8"   # marks a decode attention that also writes its output's Q8_0
ONLINE_SCALE = "qwc.attention_scale"    # marks `attention` with its score scale (compiler/fuse_decode_attention.py)


def supports(head_dim: int) -> bool:
    return head_dim % LANES == 0


# The cache's formats: float32, float16 (half the memory and the bytes a step reads at depth),
# or q8_0 (llama.cpp's: blocks of 32 int8 with a float16 scale, 34 bytes a block). The
# kernels compute in float32 whatever the format: an element is widened as it is loaded (F16C's
# vcvtph2ps, NEON's fcvtl; q8_0's int8 converted and times its block's scale) and rounded to
# nearest (q8_0: quantized per block) as it is stored.
KV_DTYPES = {"float32": 4, "float16": 2, "q8_0": 1}   # the cache formats, and their elements' bytes
Q8 = 32   # elements a q8_0 block (and a float16 scale)


def cache_width(dtype: str, head_dim: int) -> int:
    """Elements of a cache buffer's row (a key's or a value's in one kv head): head_dim; q8_0
    adds the row's float16 scales as int8 pairs (a K tile's 16 rows keep their 16 keys'
    scales in the tile's last head_dim bytes, block-major; a V row keeps its own after its
    elements)."""
    return head_dim + head_dim // 16 if dtype == "q8_0" else head_dim


def cache_element(dtype: str) -> str:
    """The cache buffers' element type in the graph and the runtime."""
    return "int8" if dtype == "q8_0" else dtype


def cache_format(element: str) -> str:
    """The cache format of a graph whose cache buffers hold `element`s."""
    return "q8_0" if str(element) == "int8" else str(element)


def head_dim_of(width: int, dtype: str) -> int:
    """The head_dim of a cache buffer row of `width` elements in `dtype`."""
    return width * 16 // 17 if dtype == "q8_0" else width


def supports_format(dtype: str, head_dim: int) -> bool:
    return supports(head_dim) and (dtype != "q8_0" or head_dim % Q8 == 0)


def scales_view(T, c, dtype: str = "q8_0", size=None):
    """A flat float16 view of cache buffer c (or of `size` elements from its data pointer): the
    scales of a q8_0 cache. The other formats read no scales and get None (a view they did not
    read still changed the float kernels' register allocation), as a meta_var: TVMScript binds
    it to a name as it is."""
    if dtype != "q8_0":
        return T.meta_var(None)
    size = c.shape[0] * c.shape[1] * c.shape[2] * c.shape[3] // 2 if size is None else size
    return T.decl_buffer((size,), "float16", data=c.data)


def k_scales(T, c16, c, b, h, first, blk, head_dim):
    """float32x16: the scales of block `blk` of keys first .. first + 15 (a K tile's) of kv head
    h, cache row b, in c16 (scales_view of the q8_0 K cache c)."""
    row = ((b * c.shape[1] + h) * c.shape[2] + first) * T.int64(cache_width("q8_0", head_dim) // 2)
    return T.Cast("float32x16", c16[T.ramp(row + head_dim * KEY_TILE // 2 + blk * KEY_TILE, 1, KEY_TILE)])


def v_scale(T, c16, c, b, h, pos, blk, head_dim):
    """float32: the scale of block `blk` of the value at `pos` of kv head h, cache row b."""
    row = ((b * c.shape[1] + h) * c.shape[2] + pos) * T.int64(cache_width("q8_0", head_dim) // 2)
    return T.Cast("float32", c16[row + head_dim // 2 + blk])


def value_weight(T, w, dtype, c16, c, b, h, pos, d, head_dim):
    """The weight w of the value at `pos` for its elements from d (kv head h, cache row b):
    times their block's scale in a q8_0 cache (c16: scales_view(c)), else w."""
    return w * v_scale(T, c16, c, b, h, pos, d // Q8, head_dim) if dtype == "q8_0" else w


def q8_store(T, cache, c16, b, h, pos, key_tiles: bool, head_dim: int, src, at: tuple):
    """Emit the q8_0 blocks of the key (`key_tiles`: into its K tile) or value at slot `pos` of
    kv head h, cache row b (c16: scales_view(cache)), from float32 elements src[*at[:-1],
    at[-1] + d]. llama.cpp's quantize_row_q8_0: per block of 32, d = max |x| / 127 (stored as
    float16) and the codes roundf(x * (1 / d)) (0 for an all-zero block). T: TVMScript's."""
    from tvm import tirx

    width = cache_width("q8_0", head_dim)
    cap = cache.shape[2]
    lead, base = tuple(at[:-1]), at[-1]

    def load(d, lanes=1):
        return tirx.BufferLoad(src, [*lead, base + d if lanes == 1 else T.ramp(base + d, 1, lanes)])

    def code(x, inv, lanes):
        ty = "float32" if lanes == 1 else f"float32x{lanes}"
        rounded = T.call_llvm_pure_intrin(ty, "llvm.round.f32" if lanes == 1 else f"llvm.round.v{lanes}f32",
                                          x * (inv if lanes == 1 else T.broadcast(inv, lanes)))
        return T.Cast("int8" if lanes == 1 else f"int8x{lanes}", rounded)

    for blk in range(head_dim // Q8):
        lo, hi = load(blk * Q8, LANES), load(blk * Q8 + LANES, LANES)
        d = T.bind(vector_math.reduce_max(T, T.max(T.fabs(lo), T.fabs(hi)), LANES) / T.float32(127))
        inv = T.bind(T.Select(d > T.float32(0), T.float32(1) / d, T.float32(0)))
        if key_tiles:   # element d of the tile's 16 keys are adjacent: a byte each
            for e in range(Q8):
                row, col = k_row_col(pos, blk * Q8 + e, head_dim, width)
                T.buffer_store(cache, code(load(blk * Q8 + e), inv, 1), [b, h, row, col])
            T.buffer_store(c16, T.Cast("float16", d), [((b * cache.shape[1] + h) * cap + pos // KEY_TILE * KEY_TILE)
                                                       * T.int64(width // 2) + head_dim * KEY_TILE // 2
                                                       + blk * KEY_TILE + pos % KEY_TILE])
        else:
            for half, x in ((0, lo), (1, hi)):
                T.buffer_store(cache, code(x, inv, LANES), [b, h, pos, T.ramp(blk * Q8 + half * LANES, 1, LANES)])
            T.buffer_store(c16, T.Cast("float16", d), [((b * cache.shape[1] + h) * cap + pos) * T.int64(width // 2)
                                                       + head_dim // 2 + blk])


def widen(T, x, dtype: str, lanes: int = 1):
    """x, `lanes` elements of the cache's `dtype`, as float32."""
    if dtype == "float32":
        return x
    return T.Cast("float32" if lanes == 1 else f"float32x{lanes}", x)


def narrow(T, x, dtype: str, lanes: int = 1):
    """x, `lanes` float32 elements, as the cache's `dtype`."""
    if dtype == "float32":
        return x
    return T.Cast(dtype if lanes == 1 else f"{dtype}x{lanes}", x)


def _check_dtype(dtype: str):
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {dtype!r} (known: {', '.join(KV_DTYPES)})")


def k_row_col(pos, d, head_dim, width: int | None = None):
    """(row, column) in the K buffer's [cap, width] view (width: head_dim's cache_width) of
    key `pos`, element d."""
    o = d * KEY_TILE + pos % KEY_TILE
    width = width or head_dim
    return pos // KEY_TILE * KEY_TILE + o // width, o % width


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def kv_cache_write(key_tiles: bool, batched: bool = False, dtype: str = "float32", head_dim: int | None = None):
    """In-place write of new K (or V) [1, s, kv_heads*head_dim] into the cache buffer
    [1, kv_heads, C, head_dim] of `dtype` at slots past .. past + s - 1, past = seqlens[0] + 1
    - s: in rows, or (`key_tiles`, K for the fast kernel) in the key-tile layout. `batched`: B
    sequences, new [B, s, ...] into cache rows [B, ...] at each row's own seqlens[b]. head_dim
    is a constant of the kernel: a key's place in its tile divided by a head_dim read at run
    time, two integer divisions an element (a 100-token prefill's K writes took 3-4 ms)."""
    from tvm.script import tirx as T

    _check_dtype(dtype)
    if not head_dim:
        raise ValueError("kv_cache_write needs the head_dim")
    if dtype == "q8_0":
        if not head_dim or head_dim % Q8:
            raise ValueError(f"a q8_0 cache needs a head_dim that is a multiple of {Q8}, not {head_dim}")
        return _q8_cache_write(key_tiles, batched, head_dim)

    @T.macro
    def put(cache, new, b, seqlen, kvh, hd, s):
        past = T.bind(T.Cast("int64", seqlen) + T.int64(1) - s)
        for h in T.serial(kvh):  # a few KiB per layer: a parallel launch would cost more
            for i, d in T.grid(s, hd):
                if key_tiles:
                    row, col = k_row_col(past + i, d, hd)
                    cache[b, h, row, col] = narrow(T, new[b, i, h * hd + d], dtype)
                else:
                    cache[b, h, past + i, d] = narrow(T, new[b, i, h * hd + d], dtype)

    if batched:
        @T.prim_func(private=True)
        def write_batch(var_cache: T.handle, var_new: T.handle, var_seqlens: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8})
            bsz, kvh, cap, s = T.int64(), T.int64(), T.int64(), T.int64()
            cache = T.match_buffer(var_cache, (bsz, kvh, cap, head_dim), dtype)
            new = T.match_buffer(var_new, (bsz, s, kvh * head_dim), "float32")
            seqlens = T.match_buffer(var_seqlens, (bsz,), "int32")
            for b in T.serial(bsz):
                put(cache, new, b, seqlens[b], kvh, head_dim, s)
        return hand_scheduled(write_batch)

    @T.prim_func(private=True)
    def write(var_cache: T.handle, var_new: T.handle, seqlens: T.Buffer((1,), "int32")):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        kvh, cap, s = T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (T.int64(1), kvh, cap, head_dim), dtype)
        new = T.match_buffer(var_new, (T.int64(1), s, kvh * head_dim), "float32")
        put(cache, new, T.int64(0), seqlens[0], kvh, head_dim, s)

    return hand_scheduled(write)


@functools.cache
def _q8_cache_write(key_tiles: bool, batched: bool, head_dim: int):
    """kv_cache_write for a q8_0 cache of head_dim (its rows cache_width wide): each new key's
    or value's blocks of 32 quantized (q8_store)."""
    from tvm.script import tirx as T

    width = cache_width("q8_0", head_dim)

    @T.macro
    def put(cache, c16, new, b, seqlen, kvh, s):
        past = T.bind(T.Cast("int64", seqlen) + T.int64(1) - s)
        for h in T.serial(kvh):  # a few KiB per layer: a parallel launch would cost more
            for i in range(s):
                q8_store(T, cache, c16, b, h, past + i, key_tiles, head_dim, new, (b, i, h * head_dim))

    if batched:
        @T.prim_func(private=True, check_well_formed=False)
        def write_batch(var_cache: T.handle, var_new: T.handle, var_seqlens: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8})
            bsz, kvh, cap, s = T.int64(), T.int64(), T.int64(), T.int64()
            cache = T.match_buffer(var_cache, (bsz, kvh, cap, width), "int8")
            new = T.match_buffer(var_new, (bsz, s, kvh * head_dim), "float32")
            seqlens = T.match_buffer(var_seqlens, (bsz,), "int32")
            c16 = scales_view(T, cache)
            for b in T.serial(bsz):
                put(cache, c16, new, b, seqlens[b], kvh, s)
        return hand_scheduled(write_batch)

    @T.prim_func(private=True, check_well_formed=False)
    def write(var_cache: T.handle, var_new: T.handle, seqlens: T.Buffer((1,), "int32")):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        kvh, cap, s = T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (T.int64(1), kvh, cap, width), "int8")
        new = T.match_buffer(var_new, (T.int64(1), s, kvh * head_dim), "float32")
        c16 = scales_view(T, cache)
        put(cache, c16, new, T.int64(0), seqlens[0], kvh, s)

    return hand_scheduled(write)


@functools.cache
def ragged_kv_cache_write(key_tiles: bool, dtype: str, head_dim: int):
    """kv_cache_write for the tokens of G segments one after another (new [1, t, ...];
    segments [G, 3]: cache row, first token, count): token i of a segment into its row of
    the cache buffer [B, ...] at positions[0, i], in rows or (`key_tiles`) the key-tile
    layout; a q8_0 cache's blocks quantized as kv_cache_write's are."""
    from tvm.script import tirx as T

    _check_dtype(dtype)
    width, element = cache_width(dtype, head_dim), cache_element(dtype)

    @T.prim_func(private=True, check_well_formed=False)
    def write(var_cache: T.handle, var_new: T.handle, var_seg: T.handle, var_pos: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})
        bsz, kvh, cap, t, g = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (bsz, kvh, cap, width), element)
        new = T.match_buffer(var_new, (T.int64(1), t, kvh * head_dim), "float32")
        seg = T.match_buffer(var_seg, (g, T.int64(3)), "int64")
        pos = T.match_buffer(var_pos, (T.int64(1), t), "int64")
        c16 = scales_view(T, cache, dtype)
        for sg in T.serial(g):   # a few KiB per layer: a parallel launch would cost more
            for i in T.serial(seg[sg, 2]):
                for h in T.serial(kvh):
                    at = T.bind(seg[sg, 1] + i)
                    if dtype == "q8_0":
                        q8_store(T, cache, c16, seg[sg, 0], h, pos[0, at], key_tiles, head_dim, new,
                                 (T.int64(0), at, h * head_dim))
                    else:
                        for d in T.serial(head_dim):
                            if key_tiles:
                                row, col = k_row_col(pos[0, at], d, head_dim)
                                cache[seg[sg, 0], h, row, col] = narrow(T, new[0, at, h * head_dim + d], dtype)
                            else:
                                cache[seg[sg, 0], h, pos[0, at], d] = narrow(T, new[0, at, h * head_dim + d], dtype)

    return hand_scheduled(write)


def query_block(T, s, block: int = QUERY_BLOCK, groups: bool = False):
    """Queries a prefill task takes for a chunk of s: `block` in long chunks, fewer in short
    ones (s // 16, at least 1), so a 48-token chunk still makes 16 tasks a head for 64-128
    threads. `groups` (query groups, AVX-512): always `block`. A block widens each span once
    for its groups, as much work as a group's pass over it: blocks of 4 at a 64-token chunk
    took 1.6x the time of blocks of 18 at 128 cached tokens (one layer, 2 threads, Intel Xeon)."""
    if groups:
        return T.int64(block)
    return T.max(T.min(s // 16, T.int64(block)), T.int64(1))


def _tree_sum(xs):
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _tree_max(T, xs):
    while len(xs) > 1:
        xs = [T.max(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _tile_scores(T, q_at, kc, kvh, t, head_dim, dtype, b=None, k16=None):
    """Tile t's 16 unscaled scores of one query (element d: q_at(d)) against kv head kvh of
    cache row b (default 0, of `dtype`; q8_0: k16 its scales_view): sum over d of q[d] * (16
    keys' element d), in CHAINS independent FMA chains."""
    b = T.int64(0) if b is None else b
    width = cache_width(dtype, head_dim)

    def part(c):
        terms = []
        for d in range(c, head_dim, CHAINS):
            row, col = k_row_col(t * KEY_TILE, d, head_dim, width)   # t * KEY_TILE: the tile's first key
            k = widen(T, kc[b, kvh, row, T.ramp(col, 1, KEY_TILE)], dtype, KEY_TILE)
            if dtype == "q8_0":
                k = k * k_scales(T, k16, kc, b, kvh, t * KEY_TILE, d // Q8, head_dim)
            terms.append(T.broadcast(q_at(d), KEY_TILE) * k)
        acc = terms[0]
        for x in terms[1:]:
            acc = acc + x
        return acc
    return _tree_sum([part(c) for c in range(CHAINS)])


def _in_tile(T, t, keys):
    """Lanes of tile t that hold one of the first `keys` keys."""
    return T.broadcast(t * KEY_TILE, KEY_TILE) + T.ramp(T.int64(0), T.int64(1), KEY_TILE) < T.broadcast(keys, KEY_TILE)


def span_queries(head_dim: int, registers: tuple[int, int]) -> int:
    """Queries of a prefill block that take a whole span together (`attention`): as many as
    half the target's vector registers hold the scores and value accumulators of (the other
    half for the span's widened keys and values, loaded once for all of them), and whose
    buffers stay under TVM's stack limit. AVX-512's 32 x 64 B: 3; AVX2's and NEON's files
    hold one query's 16 (AVX2: 8 + 8 halves) and keep the one-query kernel."""
    per_query = max(SPAN, head_dim) * 4
    return max(1, min(registers[0] * registers[1] // 2 // per_query, (STACK_BYTES - 1) // per_query))


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def attention(heads: int, kv_heads: int, head_dim: int, scale: float, batched: bool = False,
              kv_dtype: str = "float32", registers: tuple[int, int] = (16, 32), ragged: bool = False,
              singles: bool = True):
    """`batched`: B sequences (q, out [B, s, ...], caches [B, ...], seqlens [B]), each row
    attending to its own cache row up to its own seqlens[b]; one task per (row, head, query).
    `ragged`: the tokens of G segments one after another (q, out [1, t, ...], caches [B, ...];
    segments [G, 3]: cache row, first token, count; positions [1, t]), each segment's tokens
    attending to its row's cache as a prefill chunk does; a task per (block of a segment's
    queries, head, segment); `singles` False: not the one-token segments (a step's decode
    tokens, which decode_attention's segments form takes). `kv_dtype`: the caches' element
    type (KV_DTYPES). `registers`:
    the target's vector registers (targets.vector_registers), which size the query groups
    (span_queries)."""
    from tvm.script import tirx as T

    _check_dtype(kv_dtype)

    group = heads // kv_heads
    nr = 1 if batched else span_queries(head_dim, registers)   # batched: a task per query
    block = -(-QUERY_BLOCK // nr) * nr   # queries a task: whole groups
    chunks = head_dim // LANES
    kt = KEY_TILE
    q8 = kv_dtype == "q8_0"
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

    def span_tiles(p):
        """The span's SPAN_TILES 16-lane pieces of p."""
        return [p[ramp(u * kt, kt)] for u in range(SPAN_TILES)]

    def tile_scores(q, kc, k16, b, qi, h, keys, t, masked):
        """Tile t's 16 scaled scores of query qi of head h; `masked`: -inf past `keys`."""
        sc = _tile_scores(T, lambda d: q[b, qi, h * head_dim + d], kc, h // group, t, head_dim, kv_dtype, b,
                          k16) * T.broadcast(T.float32(scale), kt)
        return T.Select(_in_tile(T, t, keys), sc, T.broadcast(T.float32(NEG_INF), kt)) if masked else sc

    @T.macro
    def tile(q, kc, vc, k16, v16, acc, stat, p, b, qi, h, keys, t, masked):
        """Keys 16t .. 16t+15 of cache row b into the running state of query qi of head h;
        `masked`: only those below `keys`."""
        # the scores go to p as one expression: a name assigned twice in a macro becomes a
        # buffer, which TVM allocates from its workspace per task
        p[ramp(0, kt)] = tile_scores(q, kc, k16, b, qi, h, keys, t, masked)
        m = T.bind(T.max(stat[0], vector_math.reduce_max(T, p[ramp(0, kt)], kt)))
        r = T.bind(vector_math.exp(T, stat[0] - m, 1))   # rescale of what came before
        p[ramp(0, kt)] = vector_math.exp(T, p[ramp(0, kt)] - T.broadcast(m, kt), kt)   # masked keys: ~1e-38
        stat[0] = m
        stat[1] = stat[1] * r + vector_math.reduce_sum(T, p[ramp(0, kt)], kt)
        for c in range(chunks):
            acc[ramp(c * LANES)] = acc[ramp(c * LANES)] * T.broadcast(r, LANES)
        for j in T.unroll(kt):
            if not masked or t * kt + j < keys:
                for c in T.unroll(chunks):
                    acc[ramp(c * LANES)] = acc[ramp(c * LANES)] + widen(T, vc[
                        b, h // group, t * kt + j, ramp(c * LANES)], kv_dtype, LANES) * T.broadcast(
                            value_weight(T, p[j], kv_dtype, v16, vc, b, h // group, t * kt + j, c * LANES, head_dim),
                            LANES)

    @T.macro
    def span(q, kc, vc, out, acc, stat, p, qr, b, qi, h, t0):
        """Keys 16 t0 .. 16 t0 + SPAN - 1 (all below the query's count) into its running state
        with one rescale: the tiles' scores first (a broadcast of q[d] serves SPAN_TILES tiles;
        SPAN_TILES x 16 lanes of independent FMA chains), then their weights, then the values.
        Per key that is ~25 instructions on AVX2, 17 of them FMAs, where a tile at a time took
        ~38 with spills."""
        # The span's keys and values through pointers to their first element: every access is
        # that plus a constant, which the loads' addressing takes. Indexed from the caches,
        # LLVM computed ~1000 addresses of a span ahead of the task's loop and spilled them
        # (~2K instructions a task on ARM).
        ks = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * width,), element, data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        ks16 = scales_view(T, ks, kv_dtype, SPAN * width // 2)   # q8_0's scales
        vs16 = scales_view(T, vs, kv_dtype, SPAN * width // 2)
        for c in T.unroll(chunks):   # the scaled query, where its broadcasts load it from
            qr[ramp(c * LANES)] = q[b, qi, ramp(h * head_dim + c * LANES)] * T.broadcast(T.float32(scale), LANES)
        for u in T.unroll(SPAN_TILES):
            p[ramp(u * kt, kt)] = T.broadcast(T.float32(0), kt)
        for d in T.unroll(head_dim):
            for u in T.unroll(SPAN_TILES):   # key tile u, element d: 16 keys (the K layout)
                p[ramp(u * kt, kt)] = p[ramp(u * kt, kt)] + T.broadcast(qr[d], kt) * key_elements(ks, ks16, u, d)
        m = T.bind(T.max(stat[0], vector_math.reduce_max(T, _tree_max(T, span_tiles(p)), kt)))
        r = T.bind(vector_math.exp(T, stat[0] - m, 1))   # rescale of what came before
        for u in T.unroll(SPAN_TILES):
            p[ramp(u * kt, kt)] = vector_math.exp(T, p[ramp(u * kt, kt)] - T.broadcast(m, kt), kt)
        stat[0] = m
        stat[1] = stat[1] * r + vector_math.reduce_sum(T, _tree_sum(span_tiles(p)), kt)
        # The query's accumulators (its output row) are read only now, after the scores: held
        # through them, they and the scores' 16 vectors overflowed NEON's 32 registers. They
        # are updated in `acc`, a local buffer LLVM keeps in registers (updated in place in
        # the output, every FMA was followed by a store: the parallel task's pointers do not
        # carry the arguments' noalias).
        for c in T.unroll(chunks):
            acc[ramp(c * LANES)] = out[b, qi, ramp(h * head_dim + c * LANES)] * T.broadcast(r, LANES)
        for j in T.unroll(SPAN):
            for c in T.unroll(chunks):
                acc[ramp(c * LANES)] = acc[ramp(c * LANES)] + widen(T, vs[ramp(j * width + c * LANES)], kv_dtype,
                                                                    LANES) * T.broadcast(span_weight(vs16, p[j], j, c),
                                                                                         LANES)
        for c in T.unroll(chunks):
            out[b, qi, ramp(h * head_dim + c * LANES)] = acc[ramp(c * LANES)]

    @T.macro
    def widen_span(kc, vc, kf, vf, b, h, t0, n=None):
        """The span of keys from tile t0 into kf (the K tile layout) and vf (rows) as float32,
        q8_0's scales applied: once for a block, where each of its query groups widened them.
        With `n` (< SPAN), its first n keys: K in whole tiles (a read stays below the capacity,
        a multiple of 16; lanes past the keys are masked where they are scored), the V rows
        below n only (past them a row may be unwritten: NaN times a zero weight)."""
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
    def span_group(q, out, accs, stats, ps, ws, qrs, ks, vs, b, q0, i0, h):
        """`span` for the nr queries q0 .. q0 + nr - 1 (block entries i0 ..) that all take the
        whole span, its keys ks (the K tile layout) and values vs (rows) in float32: each key
        and value vector is loaded once for the nr queries, their scores and accumulators side
        by side in registers (nr x SPAN_TILES, then nr x chunks vectors)."""
        for r in T.unroll(nr):
            for c in T.unroll(chunks):
                qrs[ramp(r * head_dim + c * LANES)] = q[b, q0 + r, ramp(h * head_dim + c * LANES)] * T.broadcast(
                    T.float32(scale), LANES)
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
    def masked_group(q, out, accs, stats, ps, ws, qrs, ks, vs, b, q0, i0, h, count, n0):
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
        n_last = T.bind(T.min(n0 + T.int64(count - 1), T.int64(SPAN)))   # keys the group reads
        for r in T.unroll(count):
            for c in T.unroll(chunks):
                qrs[ramp(r * head_dim + c * LANES)] = q[b, q0 + r, ramp(h * head_dim + c * LANES)] * T.broadcast(
                    T.float32(scale), LANES)
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
                ps[ramp(r * SPAN + u * kt, kt)] = T.Select(_in_tile(T, T.int64(u), n0 + T.int64(r)), ps[ramp(
                    r * SPAN + u * kt, kt)], T.broadcast(T.float32(NEG_INF), kt))
            pr = [ps[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]
            m = T.bind(T.max(stats[2 * (i0 + r)], vector_math.reduce_max(T, _tree_max(T, pr), kt)))
            rs = T.bind(vector_math.exp(T, stats[2 * (i0 + r)] - m, 1))
            for u in T.unroll(SPAN_TILES):
                ws[ramp(r * SPAN + u * kt, kt)] = T.Select(
                    _in_tile(T, T.int64(u), n0 + T.int64(r)),
                    vector_math.exp(T, ps[ramp(r * SPAN + u * kt, kt)] - T.broadcast(m, kt), kt),
                    T.broadcast(T.float32(0), kt))
            stats[2 * (i0 + r)] = m
            stats[2 * (i0 + r) + 1] = stats[2 * (i0 + r) + 1] * rs + vector_math.reduce_sum(T, _tree_sum(
                [ws[ramp(r * SPAN + u * kt, kt)] for u in range(SPAN_TILES)]), kt)
            for c in T.unroll(chunks):
                accs[ramp(r * head_dim + c * LANES)] = out[b, q0 + r, ramp(h * head_dim + c * LANES)] * T.broadcast(
                    rs, LANES)
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
    def span_group_cache(q, kc, vc, out, accs, stats, ps, ws, qrs, b, q0, i0, h, t0):
        """span_group over the span of keys from tile t0, read from float32 caches."""
        ks = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        span_group(q, out, accs, stats, ps, ws, qrs, ks, vs, b, q0, i0, h)

    @T.macro
    def masked_group_cache(q, kc, vc, out, accs, stats, ps, ws, qrs, b, q0, i0, h, t0, count, n0):
        """masked_group over the span of keys from tile t0, read from float32 caches."""
        ks = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(kc[b, h // group, t0 * kt, 0])))
        vs = T.decl_buffer((SPAN * head_dim,), "float32", data=T.bind(T.address_of(vc[b, h // group, t0 * kt, 0])))
        masked_group(q, out, accs, stats, ps, ws, qrs, ks, vs, b, q0, i0, h, count, n0)

    @T.macro
    def some_span(q, kc, vc, out, accs, stats, ps, ws, qrs, kf, vf, b, q0, i0, h, sp, count, n0):
        """masked_group of the span sp, from the widened span or the float32 caches."""
        if kv_dtype != "float32":
            masked_group(q, out, accs, stats, ps, ws, qrs, kf, vf, b, q0, i0, h, count, n0)
        else:
            masked_group_cache(q, kc, vc, out, accs, stats, ps, ws, qrs, b, q0, i0, h, sp * SPAN_TILES, count, n0)

    @T.macro
    def one_query(q, kc, vc, out, acc, stat, stats, p, qr, k16, v16, b, q0, r, h, sp, past):
        """Span sp into query q0 + r's running state (stats[2r ..]): the whole span, or its
        keys up to the query's (whole tiles, then a masked one)."""
        keys = T.bind(past + q0 + r + T.int64(1))
        if sp * SPAN < keys:
            stat[0] = stats[2 * r]
            stat[1] = stats[2 * r + 1]
            if (sp + 1) * SPAN <= keys:
                span(q, kc, vc, out, acc, stat, p, qr, b, q0 + r, h, sp * SPAN_TILES)
            else:   # the query's last span: whole tiles, then a masked one
                for c in T.unroll(chunks):
                    acc[ramp(c * LANES)] = out[b, q0 + r, ramp(h * head_dim + c * LANES)]
                for t in range(sp * SPAN_TILES, keys // kt):
                    tile(q, kc, vc, k16, v16, acc, stat, p, b, q0 + r, h, keys, t, False)
                if keys % kt != 0:
                    tile(q, kc, vc, k16, v16, acc, stat, p, b, q0 + r, h, keys, keys // kt, True)
                for c in T.unroll(chunks):
                    out[b, q0 + r, ramp(h * head_dim + c * LANES)] = acc[ramp(c * LANES)]
            stats[2 * r] = stat[0]
            stats[2 * r + 1] = stat[1]

    @T.macro
    def attend(q, kc, vc, out, b, h, q0, nq, s, seqlen):
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
        qr = T.decl_buffer((head_dim,), "float32", scope="global")
        k16, v16 = scales_view(T, kc, kv_dtype), scales_view(T, vc, kv_dtype)   # q8_0's scales
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
                    one_query(q, kc, vc, out, acc, stat, stats, p, qr, k16, v16, b, q0, r, h, sp, past)
        else:
            accs = T.decl_buffer((nr * head_dim,), "float32", scope="global")   # a group's: registers
            ps = T.decl_buffer((nr * SPAN,), "float32", scope="global")
            ws = T.decl_buffer((nr * SPAN,), "float32", scope="global")
            qrs = T.decl_buffer((nr * head_dim,), "float32", scope="global")
            # the block's spans widened once (16 KiB each: workspace); the float32 caches read as they are
            kf = T.decl_buffer((SPAN * head_dim if kv_dtype != "float32" else 1,), "float32", scope="global")
            vf = T.decl_buffer((SPAN * head_dim if kv_dtype != "float32" else 1,), "float32", scope="global")
            for sp in range((last + SPAN - 1) // SPAN):
                if kv_dtype != "float32":   # the keys the block's last query reaches
                    if (sp + 1) * SPAN <= last:
                        widen_span(kc, vc, kf, vf, b, h, sp * SPAN_TILES)
                    else:
                        widen_span(kc, vc, kf, vf, b, h, sp * SPAN_TILES, last - sp * SPAN)
                for g in range((nq + nr - 1) // nr):
                    # its first query has the fewest keys: n0 of the span's (SPAN or more: all)
                    n0 = T.bind(past + q0 + g * nr + T.int64(1) - sp * SPAN)
                    if g * nr + nr <= nq and n0 >= T.int64(SPAN):
                        if kv_dtype != "float32":
                            span_group(q, out, accs, stats, ps, ws, qrs, kf, vf, b, q0 + g * nr, g * nr, h)
                        else:
                            span_group_cache(q, kc, vc, out, accs, stats, ps, ws, qrs, b, q0 + g * nr, g * nr, h,
                                             sp * SPAN_TILES)
                    elif g * nr + nr <= nq and n0 >= T.int64(1):   # the diagonal: every query reaches in
                        some_span(q, kc, vc, out, accs, stats, ps, ws, qrs, kf, vf, b, q0 + g * nr, g * nr, h, sp,
                                  nr, n0)
                    else:   # a ragged last group, or one whose first queries end before the span
                        for r in range(g * nr, T.min(g * nr + nr, nq)):
                            if past + q0 + r + T.int64(1) > sp * SPAN:
                                some_span(q, kc, vc, out, accs, stats, ps, ws, qrs, kf, vf, b, q0 + r, r, h, sp, 1,
                                          past + q0 + r + T.int64(1) - sp * SPAN)
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
    def segment_block(q, kc, vc, out, seg, pos, t, cap, sg, hh, q0, qb):
        """`ragged`'s task: the block of segment sg's queries from q0, head hh (if it has one)."""
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
            attend(qs, kr, vr, outs, T.int64(0), hh, q0, T.min(qb, n - q0), n, pos[0, first + n - 1])

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
                        segment_block(q, kc, vc, out, seg, pos, t, cap, sg, task // blocks, task % blocks * qb, qb)
            else:
                # block, then head, then segment: a long segment's tasks are every g-th, spread
                # evenly over the threads' static ranges (segment-major put its heads' tasks in
                # a few threads' ranges, and the critical path at 64 threads grew past the
                # separate calls')
                for task in T.parallel(blocks * heads * g):
                    segment_block(q, kc, vc, out, seg, pos, t, cap, task % g, task // g % heads,
                                  task // (g * heads) * qb, qb)
        return hand_scheduled(kernel_ragged.with_attr(ONLINE_SCALE, float(scale)))

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
        qb = T.bind(query_block(T, s, block, nr > 1))
        blocks = T.bind((s + qb - 1) // qb)
        # a task per block of a head's queries, head-major: a thread's run of tasks shares K and V
        for task in T.parallel(heads * blocks):
            attend(q, kc, vc, out, T.int64(0), task // blocks, task % blocks * qb,
                   T.min(qb, s - task % blocks * qb), s, seqlens[0])

    return hand_scheduled(kernel.with_attr(ONLINE_SCALE, float(scale)))


def fuses_decode_prologue(head_dim: int) -> bool:
    """Whether `decode_attention` can rotate q and k and quantize its output itself: whole
    16-lane halves of a head, whole 32-blocks of the output."""
    return head_dim % (2 * LANES) == 0


def _accumulator_bytes(registers: tuple[int, int]) -> int:
    """What a register tile's accumulators may take of a (count, bytes) vector register file:
    three quarters (the rest holds the loads and broadcasts feeding them), under STACK_BYTES
    (a larger buffer is not kept in registers)."""
    count, width = registers
    return min(STACK_BYTES - 1, count * width * 3 // 4)


def _score_tile(g: int, registers) -> tuple[int, int, int]:
    """The scores' register tile for a task of g query heads: (K tiles at once, heads a group,
    groups). Every head in one group if it fits, with SCORE_STREAMS tiles if those fit too;
    else one tile, the heads in groups that each fit (AVX2's 16 registers: 7 heads in 2
    groups of 4; 2 tiles of 7 heads, as AVX-512 takes them, spilled: the passes before the
    values 1.9x slower, kernel harness, 4k cached tokens)."""
    budget, per_head = _accumulator_bytes(registers), KEY_TILE * 4
    if SCORE_STREAMS * g * per_head <= budget:
        return SCORE_STREAMS, g, 1
    groups = -(-g * per_head // budget)
    return 1, -(-g // groups), groups


def _value_tile(g: int, head_dim: int, registers, kv_dtype: str) -> tuple[int, int, int]:
    """The values' register tile for a task of g query heads: (heads, dims, head groups), the
    one with the fewest vector operations a key, counting for each tile a key the larger of
    its FMAs and its loads (a weight broadcast per head and the V vectors, two operations
    each where they are widened from float16: a load and a convert), both at two a cycle on
    the cores qwc targets. AVX2, 7 heads: 4 heads x 16 dims, 1.16x faster than 1 x 64 (which
    widens each V vector 7 times) and 1.07x than 3 x 32 (kernel harness, 4k cached tokens)."""
    budget, width = _accumulator_bytes(registers), registers[1]
    widen_ops = {"float32": 1, "float16": 2, "q8_0": 3}[kv_dtype]   # q8_0: load, sign-extend, convert
    best = None
    for dv in range(LANES, head_dim + 1, LANES):
        if head_dim % dv or not budget // (dv * 4):
            continue
        groups = -(-g // min(g, budget // (dv * 4)))
        hv = -(-g // groups)
        fmas, loads = hv * dv * 4 // width, dv * 4 // width * widen_ops + hv
        cost = groups * head_dim // dv * max(fmas, loads)
        if best is None or cost < best[0]:
            best = cost, hv, dv, groups
    return best[1:]


@functools.cache   # a model asks for the same kernel per layer; TVMScript parsing is slow
def decode_attention(heads: int, kv_heads: int, head_dim: int, scale: float, pos_dtype: str,
                     zero_point: int | None = None, layout: str = "plain", heads_per_task: int | None = None,
                     kv_dtype: str = "float32", registers: tuple[int, int] = (16, 32),
                     split_keys: int | None = None, queries: bool = False, rows: bool = False,
                     segments: bool = False):
    """Attention of one new token (decode), one parallel task per kv head running its whole
    group of query heads, in three passes over the cached keys instead of the online update:

    1. scores: each K tile comes from memory once and serves every head of the group from
       L1; the scores go to a row per head (past * 4 bytes) and a running vector max. Tiles
       r and tiles / 2 + r are scored together (SCORE_STREAMS), a K line at a time, where
       their accumulators fit the registers; else one tile, the heads in groups that fit;
    2. exp(score - max) in place and their sum;
    3. values: in blocks of V_BLOCK keys, each block's V rows read from memory once (its
       first register tile prefetching the next block) and from L1 for its other tiles of
       a few heads x a part of the head (_value_tile).

    The register tiles follow the target's vector registers (`registers`, (count, bytes):
    targets.vector_registers): on AVX2's 16, the tiles sized for AVX-512's 32 spilled their
    accumulators; sized for 16, the kernel is 1.46x faster at 4k cached tokens, 1.8x at 16k
    (one thread, float16 cache; docs/results.md).

    No pass carries a dependency from tile to tile but a max or a sum, so the tiles overlap in
    the core, where the online form's per-tile rescale chain (max -> exp -> rescale -> update)
    serialised them: 1.5x faster than `attention` at 512 cached tokens, 1.9x at 3000 (kernel
    harness, cache-cold; docs/design.md).

    `split_keys` (a multiple of 16; None: no split): the keys in spans of that many, a task
    each, so that at depth a many-core machine has kv_heads x spans tasks (or heads x spans),
    not kv_heads. Each span's task runs the three passes over its keys and leaves its max,
    its weights' sum and its weighted values (unnormalised); a second parallel loop, a task
    per query-head group, merges the spans (each rescaled by exp(its max - the largest)) and
    writes the output and its Q8_0. With one span (keys <= split_keys) the task writes the
    output itself and the second loop is not launched. The task of the last span writes the
    new token's key and value: no other span reads that slot.

    The task also does what took four kernels of their own (a launch each, 96 a step at 24
    layers): it rotates its kv head's new key and its group's queries (rotate-half rotary at
    position_ids [1, 1] of `pos_dtype`, cos / sin [P, head_dim / 2]) and writes the key (K
    tiles) and the value (a row) into the cache at slot seqlens[0] before it reads it. With
    `zero_point` it also writes its heads' output as Q8_0 blocks (act_quant: int8, scales,
    zero_point x block sums) for the o projection's W4A8 GEMV: the quantizer kernel that
    read the output is gone too. Needs `fuses_decode_prologue(head_dim)`.

    `queries`: t new tokens of one sequence (a speculative verify call), each attending as
    its own decode step would, to the keys before it and itself: the same passes over the
    same tiles, so its output is the decode step's to the bit (the online kernel's rescaling
    is not, and a greedy reply with drafts would drift from the one without). The t keys and
    values are written first, in a loop of their own; then a task per (token, kv head or
    query heads, span). Without `zero_point` (the o projection is a GEMM there). `rows`: the
    same over one new token of each of B sequences (decode_batch: q, k, v, out [B, 1, ...],
    cache rows [B, ...], row b's new token at slot seqlens[b], positions [B, 1]), each row's
    output its decode step's to the bit. `segments`: a mixed step's one-token segments (its
    decode tokens; kernels/attention.py: attention's `ragged` form for the rest), their
    queries already rotated and their keys and values already in the cache by the step's own
    kernels, whose bits are this kernel's prologue's: q [1, t, ...] (rotated), caches [B, ...],
    segments [G, 3], positions [1, t], and out [1, t, ...] written in place at those tokens
    only.

    `layout`: the o projection's activation layout (act_quant.LAYOUTS: "plain", x86; "arm",
    the sdot GEMV's). `heads_per_task` (a divisor of the group; default the whole group):
    fewer query heads a task and more tasks, for many-core
    machines (ARM: one head a task, 14 tasks on a 0.5B where a task per kv head gives 2).
    Every task of a kv head then writes the same new key and value into the cache before it
    reads them, so whichever task's store a reader sees, the bytes are the ones it wrote.

    Arguments: q [1, 1, heads*head_dim] and k, v [1, 1, kv_heads*head_dim] before rotary, the
    K and V caches (of `kv_dtype`, written in place), seqlens [1], position_ids, cos, sin, then the outputs:
    out (q's shape) and, with `zero_point`, aq [1, NB, 32], ad and off [1, NB] (off int32)."""
    from tvm.script import tirx as T

    from .act_quant import BLOCK, quantize_block

    _check_dtype(kv_dtype)
    group = heads // kv_heads
    g = heads_per_task or group   # query heads a task; a kv head's heads are `subs` tasks
    if (group % g or layout not in ("plain", "arm") or ((queries or rows or segments) and zero_point is not None)
            or queries + rows + segments > 1):
        raise ValueError(f"decode_attention: {g} heads a task in groups of {group}, layout {layout!r}")
    subs = group // g
    chunks = head_dim // LANES
    hc = chunks // 2     # 16-lane chunks in half a head: rotate-half pairs chunk c with c +- hc
    kt = KEY_TILE
    quantize = zero_point is not None
    assert fuses_decode_prologue(head_dim)
    nb = heads * head_dim // BLOCK
    nt, hg, ng = _score_tile(g, registers)        # K tiles at once, heads a group, groups
    hv, dv, ngv = _value_tile(g, head_dim, registers, kv_dtype)   # heads x dims a value tile
    vb = V_BLOCK
    q8 = kv_dtype == "q8_0"
    width, element = cache_width(kv_dtype, head_dim), cache_element(kv_dtype)
    if not supports_format(kv_dtype, head_dim):
        raise ValueError(f"decode_attention: a {kv_dtype} cache of head_dim {head_dim}")
    # the scores' loop over a key's elements, in q8_0's blocks (whose scales it hoists)
    blocks, block = (head_dim // Q8, Q8) if q8 else (1, head_dim)
    split = split_keys is not None
    span_tiles = (split_keys or kt) // kt
    if split_keys is not None and (split_keys % kt or split_keys < kt):
        raise ValueError(f"decode_attention: split_keys {split_keys} is not a multiple of {kt}")

    def span_count(T, tiles):
        """The keys' spans (a task each): of split_keys keys, the last one shorter; or one."""
        return (tiles + T.int64(span_tiles - 1)) // T.int64(span_tiles) if split else T.int64(1)

    def span_tile_count(T, tiles, t0):
        return T.min(T.int64(span_tiles), tiles - t0) if split else tiles

    def span_keys(cap):
        return split_keys if split else cap

    @T.macro
    def rotate(dst, at, x, row, tok, base, cos, sin, p):
        """dst[at:] = the head at x[row, tok, base:] rotated at position p: x * cos + rotate_half(x) * sin,
        written as generic.rotary writes it ((-hi) * sin added, not subtracted): LLVM then
        contracts it into the same FMA and the bits are the rotary kernel's."""
        for c in range(hc):
            lo = T.bind(x[row, tok, T.ramp(base + c * LANES, 1, LANES)])
            hi = T.bind(x[row, tok, T.ramp(base + (c + hc) * LANES, 1, LANES)])
            cs = T.bind(cos[p, T.ramp(c * LANES, 1, LANES)])
            sn = T.bind(sin[p, T.ramp(c * LANES, 1, LANES)])
            dst[T.ramp(at + c * LANES, 1, LANES)] = lo * cs + (-hi) * sn
            dst[T.ramp(at + (c + hc) * LANES, 1, LANES)] = hi * cs + lo * sn

    # decode_attention's steps, run by one task per kv head (kvh) in `attend` (and per item in
    # attend_items: a verify call's tokens, a batched step's rows, a mixed step's decode tokens)
    @T.macro
    def write_new_token(k, v, kc, vc, k16, v16, kr, cos, sin, pos, kvh, slot, row, tok):
        """0: the kv head's new key (token `tok` of row `row` of k and v), rotated (kept in kr),
        and value into the row's caches at `slot`."""
        rotate(kr, 0, k, row, tok, kvh * head_dim, cos, sin, pos[row, tok])
        if q8:   # the same code as the cache writers' (kv_cache_write)
            q8_store(T, vc, v16, row, kvh, slot, False, head_dim, v, (row, tok, kvh * head_dim))
            q8_store(T, kc, k16, row, kvh, slot, True, head_dim, kr, (T.int64(0),))
        else:
            for c in range(chunks):
                vc[row, kvh, slot, T.ramp(c * LANES, 1, LANES)] = narrow(T, v[
                    row, tok, T.ramp(kvh * head_dim + c * LANES, 1, LANES)], kv_dtype, LANES)
            for d in range(head_dim):
                krow = T.bind(k_row_col(slot, d, head_dim)[0])
                col = T.bind(k_row_col(slot, d, head_dim)[1])
                kc[row, kvh, krow, col] = narrow(T, kr[d], kv_dtype)

    @T.macro
    def rotate_queries(q, qr, mx, cos, sin, pos, h0, row, tok):
        """The task's queries (heads h0 .. of token `tok` of row `row`), rotated, into qr; the
        running max lanes to -inf."""
        for hh in range(g):
            if segments:   # rotated by the step's rotary kernel: the same bits as `rotate`
                for c in range(chunks):
                    qr[T.ramp(hh * head_dim + c * LANES, 1, LANES)] = q[row, tok, T.ramp(
                        (h0 + hh) * head_dim + c * LANES, 1, LANES)]
            else:
                rotate(qr, hh * head_dim, q, row, tok, (h0 + hh) * head_dim, cos, sin, pos[row, tok])
            mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(NEG_INF), kt)

    def key_line(kc, k16, row, kvh, first, d, blk):
        """float32x16: element d (of block blk) of the 16 keys of the tile from key `first`."""
        krow, col = k_row_col(first, d, head_dim, width)
        k = widen(T, kc[row, kvh, krow, T.ramp(col, 1, kt)], kv_dtype, kt)
        return k * k_scales(T, k16, kc, row, kvh, first, blk, head_dim) if q8 else k

    @T.macro
    def score(kc, k16, row, qr, sc, mx, sacc, kvh, keys, t0, tiles):
        """1: scores of tiles t0 .. t0 + tiles into sc and their running max lanes into mx, nt
        tiles at once (streams): tiles r, per + r, ...; with tiles % nt left over, one more
        round whose streams past the last tile redo it (same values). The heads in ng groups
        of hg, each group reading the tiles' lines again from L1; heads past the group redo
        the last one (same values)."""
        per = T.bind(tiles // T.int64(nt))
        for r in range(per + T.Cast("int64", tiles % T.int64(nt) > T.int64(0))):
            for gs in T.unroll(ng):
                for blk, dd in T.grid(blocks, block):   # line d of a tile: element d of its 16 keys
                    d = T.bind(blk * block + dd)
                    if gs == 0:   # each stream's line K_PREFETCH_LINES on (past the tile: the next)
                        for i in T.unroll(nt):
                            first = T.bind((t0 + T.min(i * per + r, tiles - T.int64(1))) * T.int64(kt))
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(kc[
                                row, kvh, k_row_col(first, d + K_PREFETCH_LINES, head_dim, width)[0],
                                k_row_col(first, d + K_PREFETCH_LINES, head_dim, width)[1]]), T.int32(0), T.int32(3),
                                T.int32(1)))
                    for i in T.unroll(nt):
                        first = T.bind((t0 + T.min(i * per + r, tiles - T.int64(1))) * T.int64(kt))   # the tile's first key
                        for hh in T.unroll(hg):
                            sacc[T.ramp((i * hg + hh) * kt, 1, kt)] = sacc[T.ramp((i * hg + hh) * kt, 1, kt)] + (
                                T.broadcast(qr[T.min(gs * hg + hh, g - 1) * head_dim + d], kt)
                                * key_line(kc, k16, row, kvh, first, d, blk))
                for i in T.unroll(nt):       # past the last key: -inf
                    for hh in T.unroll(hg):
                        h = T.bind(T.min(gs * hg + hh, g - 1))
                        t = T.bind(t0 + T.min(i * per + r, tiles - T.int64(1)))
                        s = T.bind(T.Select(_in_tile(T, t, keys), sacc[T.ramp((i * hg + hh) * kt, 1, kt)]
                                            * T.broadcast(T.float32(scale), kt), T.broadcast(T.float32(NEG_INF), kt)))
                        sc[h, T.ramp((t - t0) * kt, 1, kt)] = s
                        mx[T.ramp(h * kt, 1, kt)] = T.max(mx[T.ramp(h * kt, 1, kt)], s)
                        sacc[T.ramp((i * hg + hh) * kt, 1, kt)] = T.broadcast(T.float32(0), kt)

    @T.macro
    def weigh(sc, mx, top, tot, keys, t0, tiles):
        """2: weights exp(s - max) in place of the scores (past the last key: 0); per head the
        max in top, the weights' sum in tot."""
        for hh in range(g):
            top[hh] = vector_math.reduce_max(T, mx[T.ramp(hh * kt, 1, kt)], kt)
            mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(0), kt)    # now the sum's lanes
            for t in range(t0, t0 + tiles):
                e = T.bind(T.Select(_in_tile(T, t, keys),
                                    vector_math.exp(T, sc[hh, T.ramp((t - t0) * kt, 1, kt)] - T.broadcast(top[hh], kt), kt),
                                    T.broadcast(T.float32(0), kt)))
                sc[hh, T.ramp((t - t0) * kt, 1, kt)] = e
                mx[T.ramp(hh * kt, 1, kt)] = mx[T.ramp(hh * kt, 1, kt)] + e
            tot[hh] = vector_math.reduce_sum(T, mx[T.ramp(hh * kt, 1, kt)], kt)

    @T.macro
    def values(vc, v16, row, sc, acc, accs, kvh, k0, k1):
        """3: accs = the weighted sum of the values of keys k0 .. k1 per head, in blocks of vb
        keys: the block's V rows come from DRAM for its first tile of hv heads x dv dims
        (which prefetches the next block's) and from L1 for the others; a tile accumulates in
        registers (acc), between blocks in accs. Heads past the group redo the last one."""
        for b in range((k1 - k0 + T.int64(vb - 1)) // T.int64(vb)):
            lo = T.bind(k0 + b * T.int64(vb))
            for gv in range(ngv):   # not unrolled: LLVM would keep every tile's accs in registers
                for dc in range(head_dim // dv):
                    for e in T.unroll(hv * dv // LANES):
                        acc[T.ramp(e * LANES, 1, LANES)] = accs[T.ramp(
                            ((gv * hv + e // (dv // LANES)) * head_dim + dc * dv + e % (dv // LANES) * LANES), 1, LANES)]
                    for j in range(T.min(T.int64(vb), k1 - lo)):
                        if gv == 0 and dc == 0:
                            for c in T.unroll(-(-width * KV_DTYPES[kv_dtype] // 64)):   # the row vb keys on
                                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                                    vc[row, kvh, lo + j + T.int64(vb), c * 64 // KV_DTYPES[kv_dtype]]),
                                    T.int32(0), T.int32(3), T.int32(1)))
                        for hh in T.unroll(hv):
                            for c in T.unroll(dv // LANES):
                                acc[T.ramp((hh * (dv // LANES) + c) * LANES, 1, LANES)] = acc[T.ramp(
                                    (hh * (dv // LANES) + c) * LANES, 1, LANES)] + (
                                    widen(T, vc[row, kvh, lo + j, T.ramp(dc * dv + c * LANES, 1, LANES)],
                                          kv_dtype, LANES)
                                    * T.broadcast(value_weight(T, sc[T.min(gv * hv + hh, g - 1), lo + j - k0], kv_dtype,
                                                               v16, vc, row, kvh, lo + j, dc * dv + c * LANES,
                                                               head_dim), LANES))
                    for e in T.unroll(hv * dv // LANES):
                        accs[T.ramp(((gv * hv + e // (dv // LANES)) * head_dim + dc * dv + e % (dv // LANES) * LANES),
                                    1, LANES)] = acc[T.ramp(e * LANES, 1, LANES)]

    @T.macro
    def quantize_output(out, aq, ad, off, h0):
        """4 (with zero_point): the task's heads' output as Q8_0 blocks, from the stored output:
        the same bits as the quantizer kernel reading it."""
        for hh in range(g):
            if quantize:
                for b in range(head_dim // BLOCK):
                    col = T.bind((h0 + hh) * head_dim + b * BLOCK)
                    quantize_block(T, out[T.int64(0), T.int64(0), T.ramp(col, 1, LANES)],
                                   out[T.int64(0), T.int64(0), T.ramp(col + LANES, 1, LANES)],
                                   aq, ad, off, T.int64(0), col // BLOCK, zero_point,
                                   None if layout == "plain" else ((lambda e: col + e), (col // BLOCK,)))

    @T.macro
    def merge(part, out, aq, ad, off, spans, h0, first, row, tok):
        """5 (keys in several spans): the task's heads' output from its spans' partial results
        (part rows first .. first + spans: per head its max, its weights' sum, its weighted
        values), each span's rescaled by exp(its max - the largest), as the online softmax
        does; then the Q8_0 blocks."""
        for hh in range(g):
            m = T.decl_buffer((1,), "float32", scope="global")
            m[0] = T.float32(NEG_INF)
            for sp in range(spans):
                m[0] = T.max(m[0], part[first + sp, hh, 0])
            den = T.decl_buffer((1,), "float32", scope="global")
            num = T.decl_buffer((head_dim,), "float32", scope="global")
            den[0] = T.float32(0)
            for c in T.unroll(chunks):
                num[T.ramp(c * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
            for sp in range(spans):
                w = T.bind(T.exp(part[first + sp, hh, 0] - m[0]))
                den[0] = den[0] + part[first + sp, hh, 1] * w
                for c in T.unroll(chunks):
                    num[T.ramp(c * LANES, 1, LANES)] = num[T.ramp(c * LANES, 1, LANES)] + part[
                        first + sp, hh, T.ramp(2 + c * LANES, 1, LANES)] * T.broadcast(w, LANES)
            for c in T.unroll(chunks):
                out[row, tok, T.ramp((h0 + hh) * head_dim + c * LANES, 1, LANES)] = (
                    num[T.ramp(c * LANES, 1, LANES)] / T.broadcast(den[0], LANES))
        quantize_output(out, aq, ad, off, h0)

    @T.macro
    def span_task(q, k, v, kc, vc, k16, v16, cap, pos, cos, sin, out, aq, ad, off, part, task, row, tok, crow,
                  kvh, h0, keys, t0, n, spans, write, slot):
        """One task: the heads h0 .. h0 + g of token `tok` of row `row` of q over tiles t0 .. t0 + n
        of its `keys` (one of its `spans`) in cache row `crow`, first writing its new key and
        value at `slot` where `write`; the output (one span) or the span's partial result in
        part[task]."""
        sc = T.alloc_buffer((g, span_keys(cap)), "float32")   # the span's scores, then weights, per head
        mx = T.decl_buffer((g * kt,), "float32", scope="global")   # running max lanes
        top = T.decl_buffer((g,), "float32", scope="global")       # max of the scores
        tot = T.decl_buffer((g,), "float32", scope="global")       # sum of the weights
        qr = T.decl_buffer((g * head_dim,), "float32", scope="global")   # the task's queries
        kr = T.decl_buffer((head_dim,), "float32", scope="global")           # the new key
        # the accumulators (under STACK_BYTES each), zeroed here so that they live through
        # the whole task: TVM's storage planner would otherwise give them qr's memory,
        # which is in the workspace pool
        sacc = T.decl_buffer((nt * hg * kt,), "float32", scope="global")   # scores of nt tiles
        acc = T.decl_buffer((hv * dv,), "float32", scope="global")   # a value tile
        accs = T.alloc_buffer((ngv * hv * head_dim,), "float32")   # every head's values
        for i in T.unroll(nt * hg):
            sacc[T.ramp(i * kt, 1, kt)] = T.broadcast(T.float32(0), kt)
        for i in T.unroll(hv * dv // LANES):
            acc[T.ramp(i * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for i in range(ngv * hv * chunks):
            accs[T.ramp(i * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        if write:   # the span that holds the new token's slot
            write_new_token(k, v, kc, vc, k16, v16, kr, cos, sin, pos, kvh, slot, row, tok)
        rotate_queries(q, qr, mx, cos, sin, pos, h0, row, tok)
        score(kc, k16, crow, qr, sc, mx, sacc, kvh, keys, t0, n)
        weigh(sc, mx, top, tot, keys, t0, n)
        values(vc, v16, crow, sc, acc, accs, kvh, t0 * T.int64(kt), T.min(keys, (t0 + n) * T.int64(kt)))
        if spans == T.int64(1):
            for hh in range(g):
                for c in T.unroll(chunks):
                    out[row, tok, T.ramp((h0 + hh) * head_dim + c * LANES, 1, LANES)] = (
                        accs[T.ramp(hh * head_dim + c * LANES, 1, LANES)] / T.broadcast(tot[hh], LANES))
            quantize_output(out, aq, ad, off, h0)
        else:
            for hh in range(g):
                part[task, hh, 0] = top[hh]
                part[task, hh, 1] = tot[hh]
                for c in T.unroll(chunks):
                    part[task, hh, T.ramp(2 + c * LANES, 1, LANES)] = accs[T.ramp(hh * head_dim + c * LANES, 1, LANES)]

    @T.macro
    def attend(q, k, v, kc, vc, cap, seqlens, pos, cos, sin, out, aq, ad, off):
        # T.bind: a plain assignment here became a workspace allocation per call
        slot = T.bind(T.Cast("int64", seqlens[0]))         # the new token's cache slot
        keys = T.bind(slot + T.int64(1))                   # it attends to slots 0 .. seqlens[0]
        tiles = T.bind((keys + T.int64(kt - 1)) // T.int64(kt))
        spans = T.bind(span_count(T, tiles))
        # with several spans, each task's partial result: per head max, sum, weighted values
        # (sized by cap: the spans' count is bound after the allocations TVM hoists to the top)
        part = T.alloc_buffer((kv_heads * subs * (cap // T.int64(span_keys(cap)) + T.int64(1)), g, head_dim + 2),
                              "float32")
        k16, v16 = scales_view(T, kc, kv_dtype), scales_view(T, vc, kv_dtype)   # q8_0's scales
        for task in T.parallel(kv_heads * subs * spans):
            kvh = T.bind(task // (subs * spans))
            h0 = T.bind(kvh * group + task // spans % subs * g)    # the task's first query head
            t0 = T.bind(task % spans * T.int64(span_tiles))        # the span's first tile
            n = T.bind(span_tile_count(T, tiles, t0))              # and its tiles
            span_task(q, k, v, kc, vc, k16, v16, cap, pos, cos, sin, out, aq, ad, off, part, task, T.int64(0),
                      T.int64(0), T.int64(0), kvh, h0, keys, t0, n, spans, task % spans == spans - T.int64(1), slot)
        if spans > T.int64(1):
            for task in T.parallel(kv_heads * subs):
                merge(part, out, aq, ad, off, spans, task // subs * group + task % subs * g, task * spans, T.int64(0),
                      T.int64(0))

    def item(i, segs):
        """Item i of a call: (its row of q, its token there, its cache row)."""
        if segments:
            return T.int64(0), segs[i, 1], segs[i, 0]
        return (i, T.int64(0), i) if rows else (T.int64(0), i, T.int64(0))

    def item_slot(i, seqlens, first, segs, pos):
        """Item i's slot, the last key it attends to: a verify call's seqlens[0] + 1 - t + i, row
        b's seqlens[b], a step segment's position."""
        if segments:
            return T.Cast("int64", pos[T.int64(0), segs[i, 1]])
        return T.Cast("int64", seqlens[i]) if rows else first + i

    def item_taken(i, segs):
        """Whether item i attends here (a step's one-token segments only)."""
        return segs[i, 2] == T.int64(1) if segments else T.bool(True)

    @T.macro
    def attend_items(q, k, v, kc, vc, cap, items, seqlens, segs, pos, cos, sin, out):
        """`queries` (t tokens of row 0), `rows` (a token of each of B rows) or `segments` (a
        step's one-token segments): every item's new key and value written first (segments:
        the step's kernels wrote them), then each item's tasks as its own decode step's (its
        keys up to its slot)."""
        first = T.bind(T.int64(0) if segments else T.Cast("int64", seqlens[0]) + T.int64(1) - items)
        most = T.decl_buffer((1,), "int64", scope="global")   # the last slot of any item
        most[0] = T.int64(0)
        for i in range(items):
            if item_taken(i, segs):
                most[0] = T.max(most[0], item_slot(i, seqlens, first, segs, pos))
        spans = T.bind(span_count(T, (most[0] + T.int64(kt)) // T.int64(kt)))   # an item's at most
        per = T.bind(kv_heads * subs * spans)              # tasks an item
        part = T.alloc_buffer((items * kv_heads * subs * (cap // T.int64(span_keys(cap)) + T.int64(1)), g,
                               head_dim + 2), "float32")
        k16, v16 = scales_view(T, kc, kv_dtype), scales_view(T, vc, kv_dtype)
        if not segments:
            for kvh in T.parallel(kv_heads):   # every new key and value before any task reads them
                kr = T.decl_buffer((head_dim,), "float32", scope="global")
                for i in range(items):
                    write_new_token(k, v, kc, vc, k16, v16, kr, cos, sin, pos, kvh,
                                    item_slot(i, seqlens, first, segs, pos), item(i, segs)[0], item(i, segs)[1])
        for task in T.parallel(items * per):
            i = T.bind(task // per)
            keys = T.bind(item_slot(i, seqlens, first, segs, pos) + T.int64(1))
            tiles = T.bind((keys + T.int64(kt - 1)) // T.int64(kt))
            own = T.bind(span_count(T, tiles))   # the item's spans (fewer than the most)
            r = T.bind(task % per)
            kvh = T.bind(r // (subs * spans))
            h0 = T.bind(kvh * group + r // spans % subs * g)
            t0 = T.bind(r % spans * T.int64(span_tiles))
            if item_taken(i, segs) and r % spans < own:
                n = T.bind(span_tile_count(T, tiles, t0))
                span_task(q, k, v, kc, vc, k16, v16, cap, pos, cos, sin, out, None, None, None, part, task,
                          item(i, segs)[0], item(i, segs)[1], item(i, segs)[2], kvh, h0, keys, t0, n, own, False,
                          None)
        if spans > T.int64(1):
            for task in T.parallel(items * kv_heads * subs):
                i = T.bind(task // (kv_heads * subs))
                own = T.bind(span_count(T, (item_slot(i, seqlens, first, segs, pos) + T.int64(kt)) // T.int64(kt)))
                if item_taken(i, segs) and own > T.int64(1):
                    # the group's spans are part rows task * spans .. (the loop above's task order)
                    merge(part, out, None, None, None, own, task % (kv_heads * subs) // subs * group
                          + task % subs * g, task * spans, item(i, segs)[0], item(i, segs)[1])

    @T.macro
    def kernel_body(var_q, var_k, var_v, var_kc, var_vc, seqlens, pos, var_cos, var_sin, var_out, aq, ad, off):
        # opaque: FuseOps leaves it whole; WRITES_Q8 tells the o projection its input is quantized
        T.func_attr({"tir.noalias": True, "op_pattern": 8, WRITES_Q8: quantize})
        cap, positions = T.int64(), T.int64()
        q = T.match_buffer(var_q, (T.int64(1), T.int64(1), heads * head_dim), "float32")
        k = T.match_buffer(var_k, (T.int64(1), T.int64(1), kv_heads * head_dim), "float32")
        v = T.match_buffer(var_v, (T.int64(1), T.int64(1), kv_heads * head_dim), "float32")
        kc = T.match_buffer(var_kc, (T.int64(1), kv_heads, cap, width), element)
        vc = T.match_buffer(var_vc, (T.int64(1), kv_heads, cap, width), element)
        cos = T.match_buffer(var_cos, (positions, head_dim // 2), "float32")
        sin = T.match_buffer(var_sin, (positions, head_dim // 2), "float32")
        out = T.match_buffer(var_out, (T.int64(1), T.int64(1), heads * head_dim), "float32")
        assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
        if quantize and layout == "arm":   # quantize_block addresses the blocks flat
            attend(q, k, v, kc, vc, cap, seqlens, pos, cos, sin, out,
                   T.decl_buffer((nb * BLOCK,), "int8", data=aq.data), T.decl_buffer((nb,), "float32", data=ad.data),
                   T.decl_buffer((nb,), "int32", data=off.data))
        else:
            attend(q, k, v, kc, vc, cap, seqlens, pos, cos, sin, out, aq, ad, off)

    @T.macro
    def items_body(var_q, var_k, var_v, var_kc, var_vc, var_seqlens, var_pos, var_cos, var_sin, var_out, cap,
                   positions, items, b, t):
        """`queries` / `rows`: q [b, t, ...] with b = 1, t = items or b = items, t = 1."""
        T.func_attr({"tir.noalias": True, "op_pattern": 8, WRITES_Q8: False})
        q = T.match_buffer(var_q, (b, t, heads * head_dim), "float32")
        k = T.match_buffer(var_k, (b, t, kv_heads * head_dim), "float32")
        v = T.match_buffer(var_v, (b, t, kv_heads * head_dim), "float32")
        seqlens = T.match_buffer(var_seqlens, (b,), "int32")
        pos = T.match_buffer(var_pos, (b, t), pos_dtype)
        kc = T.match_buffer(var_kc, (b, kv_heads, cap, width), element)
        vc = T.match_buffer(var_vc, (b, kv_heads, cap, width), element)
        cos = T.match_buffer(var_cos, (positions, head_dim // 2), "float32")
        sin = T.match_buffer(var_sin, (positions, head_dim // 2), "float32")
        out = T.match_buffer(var_out, (b, t, heads * head_dim), "float32")
        assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
        attend_items(q, k, v, kc, vc, cap, items, seqlens, None, pos, cos, sin, out)

    if segments:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_kc: T.handle, var_vc: T.handle, var_segs: T.handle, var_pos: T.handle,
                   var_out: T.handle):
            T.func_attr({"tir.noalias": True, "op_pattern": 8, WRITES_Q8: False})
            rows_, cap, t, count = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(var_q, (T.int64(1), t, heads * head_dim), "float32")
            kc = T.match_buffer(var_kc, (rows_, kv_heads, cap, width), element)
            vc = T.match_buffer(var_vc, (rows_, kv_heads, cap, width), element)
            segs = T.match_buffer(var_segs, (count, T.int64(3)), "int64")
            pos = T.match_buffer(var_pos, (T.int64(1), t), pos_dtype)
            out = T.match_buffer(var_out, (T.int64(1), t, heads * head_dim), "float32")
            assert cap % T.int64(kt) == T.int64(0), "the KV cache capacity must be a multiple of 16"
            attend_items(q, None, None, kc, vc, cap, count, None, segs, pos, None, None, out)
        return hand_scheduled(kernel)

    if rows or queries:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   var_seqlens: T.handle, var_pos: T.handle, var_cos: T.handle, var_sin: T.handle,
                   var_out: T.handle):
            cap, positions, items = T.int64(), T.int64(), T.int64()
            items_body(var_q, var_k, var_v, var_kc, var_vc, var_seqlens, var_pos, var_cos, var_sin, var_out, cap,
                       positions, items, items if rows else T.int64(1), T.int64(1) if rows else items)
        return hand_scheduled(kernel)

    if quantize:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
                   var_sin: T.handle, var_out: T.handle, aq: T.Buffer((1, nb, BLOCK), "int8"),
                   ad: T.Buffer((1, nb), "float32"), off: T.Buffer((1, nb), "int32")):
            kernel_body(var_q, var_k, var_v, var_kc, var_vc, seqlens, pos, var_cos, var_sin, var_out, aq, ad, off)
        return hand_scheduled(kernel)

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
               seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
               var_sin: T.handle, var_out: T.handle):
        kernel_body(var_q, var_k, var_v, var_kc, var_vc, seqlens, pos, var_cos, var_sin, var_out, None, None, None)
    return hand_scheduled(kernel)
