"""The KV cache's formats and the kernels that write new keys and values into it.

Formats: float32, float16 (half the memory and the bytes a step reads at depth), or q8_0
(llama.cpp's: blocks of 32 int8 with a float16 scale, 34 bytes a block). The attention kernels
compute in float32 whatever the format: an element is widened as it is loaded (F16C's
vcvtph2ps, NEON's fcvtl; q8_0's int8 converted and times its block's scale) and rounded to
nearest (q8_0: quantized per block) as it is stored.

K layout ("key tiles"): the K cache buffer [1, kv_heads, cap, head_dim] holds, per kv head,
tiles of KEY_TILE keys stored transposed: element d of key p is at flat offset
(p // 16) * 16 * head_dim + d * 16 + p % 16 within the head. One vector load then gives 16
keys' element d, so a tile's 16 scores are head_dim broadcast FMAs with no horizontal sum per
key (the row layout needs one per key). V keeps the row layout: the value update is a
broadcast FMA per key. cap must be a multiple of 16 (the runtime allocates so).

The readers are kernels/prefill_attention.py and kernels/decode_attention.py.
"""

from __future__ import annotations

from . import hand_scheduled, vector_math
from .kernel_cache import cached_kernel

KEY_TILE = 16    # keys per tile of the K layout and per online-softmax step
PARALLEL_KEYS = KEY_TILE   # new keys from which the K write runs in parallel (kv_cache_write)
LANES = 16       # fp32 lanes of the value accumulator's vectors
# TVM serves a constant-size buffer under 1 KiB from the stack, where LLVM keeps it in
# registers; a larger one from its workspace pool, which LLVM cannot tell apart from the other
# buffers, so every update of it is stored (the values pass was bound by those stores).
STACK_BYTES = 1024
NEG_INF = -3.0e38  # the running max's start and masked lanes' score (finite: no inf - inf)


def supports(head_dim: int) -> bool:
    return head_dim % LANES == 0


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


def check_dtype(dtype: str):
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {dtype!r} (known: {', '.join(KV_DTYPES)})")


def k_row_col(pos, d, head_dim, width: int | None = None):
    """(row, column) in the K buffer's [cap, width] view (width: head_dim's cache_width) of
    key `pos`, element d."""
    o = d * KEY_TILE + pos % KEY_TILE
    width = width or head_dim
    return pos // KEY_TILE * KEY_TILE + o // width, o % width


def in_tile(T, t, keys):
    """Lanes of tile t that hold one of the first `keys` keys."""
    return T.broadcast(t * KEY_TILE, KEY_TILE) + T.ramp(T.int64(0), T.int64(1), KEY_TILE) < T.broadcast(keys, KEY_TILE)


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def kv_cache_write(key_tiles: bool, batched: bool = False, dtype: str = "float32", head_dim: int | None = None):
    """In-place write of new K (or V) [1, s, kv_heads*head_dim] into the cache buffer
    [1, kv_heads, C, head_dim] of `dtype` at slots past .. past + s - 1, past = seqlens[0] + 1
    - s: in rows, or (`key_tiles`, K for the fast kernel) in the key-tile layout. `batched`: B
    sequences, new [B, s, ...] into cache rows [B, ...] at each row's own seqlens[b]. head_dim
    is a constant of the kernel: a key's place in its tile divided by a head_dim read at run
    time, two integer divisions an element."""
    from tvm.script import tirx as T

    check_dtype(dtype)
    if not head_dim:
        raise ValueError("kv_cache_write needs the head_dim")
    if dtype == "q8_0":
        if not head_dim or head_dim % Q8:
            raise ValueError(f"a q8_0 cache needs a head_dim that is a multiple of {Q8}, not {head_dim}")
        return _q8_cache_write(key_tiles, batched, head_dim)

    @T.macro
    def put(cache, new, b, seqlen, kvh, hd, s):
        past = T.bind(T.Cast("int64", seqlen) + T.int64(1) - s)
        if key_tiles and s >= PARALLEL_KEYS:
            # a prompt's keys, a task a head and token: scattered into their tiles an element
            # at a time, they were the one serial kernel of a long prefill at 64-128 threads
            for hi in T.parallel(kvh * s):
                # through pointers to the key's row and its tile: each element lands at
                # d x 16 + the key's lane (k_row_col), an add and a store
                pos = T.bind(past + hi % s)
                lane = T.bind(pos % KEY_TILE)
                src = T.decl_buffer((hd,), "float32", data=T.bind(T.address_of(new[b, hi % s, hi // s * hd])))
                tile = T.decl_buffer((KEY_TILE * hd,), dtype,
                                     data=T.bind(T.address_of(cache[b, hi // s, pos - lane, 0])))
                for d in T.serial(hd):
                    tile[d * KEY_TILE + lane] = narrow(T, src[d], dtype)
        else:
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


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
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


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def ragged_kv_cache_write(key_tiles: bool, dtype: str, head_dim: int):
    """kv_cache_write for the tokens of G segments one after another (new [1, t, ...];
    segments [G, 3]: cache row, first token, count): token i of a segment into its row of
    the cache buffer [B, ...] at positions[0, i], in rows or (`key_tiles`) the key-tile
    layout; a q8_0 cache's blocks quantized as kv_cache_write's are."""
    from tvm.script import tirx as T

    check_dtype(dtype)
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

