"""Decode attention: one new token (or a few, each as its own decode step) over the KV-cache
buffers, in three passes over the cached keys instead of prefill's online update.

A parallel task per kv head runs its whole group of query heads (or fewer heads a task, for
many-core machines):

1. scores: each K tile comes from memory once and serves every head of the group from L1; the
   scores go to a row per head (past * 4 bytes) and a running vector max. Tiles r and
   tiles / 2 + r are scored together (SCORE_STREAMS), a K line at a time, where their
   accumulators fit the registers; else one tile, the heads in groups that fit;
2. exp(score - max) in place and their sum;
3. values: in blocks of V_BLOCK keys, each block's V rows read from memory once (its first
   register tile prefetching the next block) and from L1 for its other tiles of a few heads x
   a part of the head (_value_tile).

The register tiles follow the target's vector registers ((count, bytes):
targets.vector_registers): tiles sized for AVX-512's 32 registers spill their accumulators on
AVX2's 16 (docs/history/long-context.md has the measurements).

No pass carries a dependency from tile to tile but a max or a sum, so the tiles overlap in the
core, where the online form's per-tile rescale chain (max -> exp -> rescale -> update)
serialises them (docs/design.md).

Split keys: at depth the keys split in spans, a task each, so that a many-core machine has
kv_heads x spans tasks (or heads x spans), not kv_heads. Each span's task runs the three passes
over its keys and leaves its max, its weights' sum and its weighted values (unnormalised); a
second parallel loop, a task per query-head group, merges the spans (each rescaled by exp(its
max - the largest)) and writes the output and its Q8_0. With one span the task writes the
output itself and the second loop is not launched. The task of the last span writes the new
token's key and value: no other span reads that slot.

Prologue and epilogue: the task also does what took four kernels of their own (a launch each
per layer): it rotates its kv head's new key and its group's queries (rotate-half rotary) and
writes the key (K tiles) and the value (a row) into the cache before it reads it; with a zero
point it also writes its heads' output as Q8_0 blocks for the o projection's W4A8 GEMV, so the
quantizer kernel that read the output is gone too. When several tasks share a kv head, each
writes the same new key and value before it reads them, so whichever store a reader sees, the
bytes are the ones it wrote.

The macros take their call's tensors as one bundle (_Call) and a task's scratch as another
(_Scratch). The cache formats and K layout: kernels/kv_cache.py.

The call's forms (decode_attention's arguments):

- `heads_per_task` (a divisor of the group; default the whole group): fewer query heads a
  task and more tasks (ARM: one head a task);
- `split_keys` (a multiple of 16; None: no split): the keys in spans of that many, a task
  each, merged after;
- `registers`: the target's vector registers, which size the register tiles;
- `queries`: t new tokens of one sequence (a speculative verify call), each attending as
  its own decode step would, to the keys before it and itself: the same passes over the
  same tiles, so its output is the decode step's to the bit (the online kernel's rescaling
  is not, and a greedy reply with drafts would drift from the one without). The t keys
  and values are written first, in a loop of their own; then a task per (token, kv head
  or query heads, span);
- `rows`: the same over one new token of each of B sequences (decode_batch: q, k, v, out
  [B, 1, ...], cache rows [B, ...], row b's new token at slot seqlens[b], positions
  [B, 1]), each row's output its decode step's to the bit;
- `segments`: a mixed step's one-token segments (its decode tokens; prefill_attention's
  `ragged` form takes the rest), their queries already rotated and their keys and values
  already in the cache by the step's own kernels, whose bits are this kernel's prologue's:
  q [1, t, ...] (rotated), caches [B, ...], segments [G, 3], positions [1, t], and out
  [1, t, ...] written in place at those tokens only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import hand_scheduled, vector_math
from .kernel_cache import cached_kernel
from .kv_cache import (
    KEY_TILE,
    KV_DTYPES,
    LANES,
    NEG_INF,
    Q8,
    STACK_BYTES,
    cache_element,
    cache_width,
    check_dtype,
    in_tile,
    k_row_col,
    k_scales,
    narrow,
    q8_store,
    scales_view,
    supports_format,
    value_weight,
    widen,
)

# Decode attention reads each K tile and V row once, from DRAM, at what one core can pull: its
# passes are reads. So the scores keep several streams in flight, each with a software
# prefetch K_PREFETCH_LINES lines ahead into L1 (a float32 tile of keys is one 4 KiB page, where
# the hardware streamer restarts); on the Xeon it was tuned on, 8 or 32 lines ahead were no
# faster. An AMD Zen's scores pass waited on its K lines at that distance (a float16 line is
# half a float32 one, so 16 lines are 512 bytes); 4 KiB ahead in bytes, whatever the cache's
# type, keeps it fed (`key_prefetch`, targets.Kernels.decode_key_prefetch). The values pass
# reads V a block at a time, the next block prefetched while the first tile of this one runs
# (two blocks ahead, or none, were slower).
SCORE_STREAMS = 2        # K tiles scored at once (if their accumulators fit the registers)
K_PREFETCH_LINES = 16    # lines of 16 keys ahead in each K stream, where `key_prefetch` is None
V_BLOCK = 64             # keys a block of the values pass (8 KiB of f16 V at head_dim 64: in L1)
WRITES_Q8 = "qwc.decode_attention_q8"   # marks a decode attention that also writes its output's Q8_0


class _Call(NamedTuple):
    """A call's tensors: the queries, the new keys and values (None where the step's kernels
    wrote them), the caches, their q8_0 scale views (None for float caches) and capacity, the
    positions and rotary tables, the output and its Q8_0 blocks (None without a zero point),
    and the spans' partial results."""
    q: Any
    k: Any
    v: Any
    kc: Any
    vc: Any
    k16: Any
    v16: Any
    cap: Any
    pos: Any
    cos: Any
    sin: Any
    out: Any
    aq: Any
    ad: Any
    off: Any
    part: Any
    qg: Any = None     # Qwen3's QK-norm gains [head_dim] of q and k (None: no norm)
    kg: Any = None


class _Scratch(NamedTuple):
    """A task's buffers: its span's scores (then weights) per head, running max lanes, each
    head's max and weights' sum, the rotated queries, the scores' and a value tile's
    accumulators, and every head's values."""
    sc: Any
    mx: Any
    top: Any
    tot: Any
    qr: Any
    sacc: Any
    acc: Any
    accs: Any


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
    values slower, kernel harness, 4k cached tokens: docs/history/long-context.md)."""
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
    the cores qwc targets. AVX2, 7 heads: 4 heads x 16 dims, faster than 1 x 64 (which
    widens each V vector 7 times) and than 3 x 32 (kernel harness, 4k cached tokens)."""
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


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def decode_attention(heads: int, kv_heads: int, head_dim: int, scale: float, pos_dtype: str,
                     zero_point: int | None = None, layout: str = "plain", heads_per_task: int | None = None,
                     kv_dtype: str = "float32", registers: tuple[int, int] = (16, 32),
                     split_keys: int | None = None, queries: bool = False, rows: bool = False,
                     segments: bool = False, head_norm: float | None = None, key_prefetch: int | None = None):
    """Arguments: q [1, 1, heads*head_dim] and k, v [1, 1, kv_heads*head_dim] before rotary, the
    K and V caches (of `kv_dtype`, written in place at slot seqlens[0]), seqlens [1],
    position_ids [1, 1] of `pos_dtype`, cos / sin [P, head_dim / 2], then the outputs: out (q's
    shape) and, with `zero_point`, aq [1, NB, 32], ad and off [1, NB] (off int32: act_quant's
    blocks, in `layout`, act_quant.LAYOUTS: "plain" on x86, "arm" the sdot GEMV's). Needs
    `fuses_decode_prologue(head_dim)`.

    The modes (`heads_per_task`, `split_keys`, `registers`, `queries`, `rows`, `segments`) are
    described under "The call's forms" in the module's docstring.

    `queries`, `rows` and `segments` take no `zero_point` (the o projection is a GEMM there).

    `key_prefetch`: bytes each K stream prefetches ahead (None: K_PREFETCH_LINES lines).

    `head_norm` (an epsilon; not with `segments`, whose queries come normed and rotated): Qwen3's
    QK-norm, each head of q and k normed before it is rotated (kernels/head_norm.py), its gains
    q_gain, k_gain [head_dim] the two arguments after sin."""
    from tvm.script import tirx as T

    from .act_quant import BLOCK, quantize_block
    from .head_norm import inv_rms

    check_dtype(kv_dtype)
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
    # a K line is element d of a tile's 16 keys
    ahead = K_PREFETCH_LINES if key_prefetch is None else -(-key_prefetch // (kt * KV_DTYPES[kv_dtype]))
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

    norm = head_norm is not None
    if norm and segments:
        raise ValueError("decode_attention: a mixed step's queries come normed; head_norm goes with the others")
    rms = inv_rms(T, head_dim, head_norm if norm else 0.0)

    @T.macro
    def rotate(dst, at, x, row, tok, base, cos, sin, p, gain):
        """dst[at:] = the head at x[row, tok, base:] rotated at position p: x * cos + rotate_half(x) * sin,
        written as generic.rotary writes it ((-hi) * sin added, not subtracted): LLVM then
        contracts it into the same FMA and the bits are the rotary kernel's. With head_norm the
        head is normed first, times `gain`, as generic.rotary_halves norms it."""
        if norm:
            sq = T.decl_buffer((head_dim + 1,), "float32", scope="global")   # a stack slot
            rms(x, row, tok, base, sq)
            for c in range(hc):
                lo = T.bind(x[row, tok, T.ramp(base + c * LANES, 1, LANES)] * T.broadcast(sq[head_dim], LANES)
                            * gain[T.ramp(c * LANES, 1, LANES)])
                hi = T.bind(x[row, tok, T.ramp(base + (c + hc) * LANES, 1, LANES)] * T.broadcast(sq[head_dim], LANES)
                            * gain[T.ramp((c + hc) * LANES, 1, LANES)])
                cs = T.bind(cos[p, T.ramp(c * LANES, 1, LANES)])
                sn = T.bind(sin[p, T.ramp(c * LANES, 1, LANES)])
                dst[T.ramp(at + c * LANES, 1, LANES)] = lo * cs + (-hi) * sn
                dst[T.ramp(at + (c + hc) * LANES, 1, LANES)] = hi * cs + lo * sn
        else:
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
    def write_new_token(io, kr, kvh, slot, row, tok):
        """0: the kv head's new key (token `tok` of row `row` of k and v), rotated (kept in kr),
        and value into the row's caches at `slot`."""
        k, v, kc, vc, k16, v16, cos, sin, pos = T.meta_var((io.k, io.v, io.kc, io.vc, io.k16, io.v16, io.cos, io.sin,
                                                            io.pos))
        rotate(kr, 0, k, row, tok, kvh * head_dim, cos, sin, pos[row, tok], io.kg)
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
    def rotate_queries(io, qr, mx, h0, row, tok):
        """The task's queries (heads h0 .. of token `tok` of row `row`), rotated, into qr; the
        running max lanes to -inf."""
        q, cos, sin, pos = T.meta_var((io.q, io.cos, io.sin, io.pos))
        for hh in range(g):
            if segments:   # rotated by the step's rotary kernel: the same bits as `rotate`
                for c in range(chunks):
                    qr[T.ramp(hh * head_dim + c * LANES, 1, LANES)] = q[row, tok, T.ramp(
                        (h0 + hh) * head_dim + c * LANES, 1, LANES)]
            else:
                rotate(qr, hh * head_dim, q, row, tok, (h0 + hh) * head_dim, cos, sin, pos[row, tok], io.qg)
            mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(NEG_INF), kt)

    def key_line(kc, k16, row, kvh, first, d, blk):
        """float32x16: element d (of block blk) of the 16 keys of the tile from key `first`."""
        krow, col = k_row_col(first, d, head_dim, width)
        k = widen(T, kc[row, kvh, krow, T.ramp(col, 1, kt)], kv_dtype, kt)
        return k * k_scales(T, k16, kc, row, kvh, first, blk, head_dim) if q8 else k

    @T.macro
    def score(io, scratch, row, kvh, keys, t0, tiles):
        """1: scores of tiles t0 .. t0 + tiles into sc and their running max lanes into mx, nt
        tiles at once (streams): tiles r, per + r, ...; with tiles % nt left over, one more
        round whose streams past the last tile redo it (same values). The heads in ng groups
        of hg, each group reading the tiles' lines again from L1; heads past the group redo
        the last one (same values)."""
        kc, k16 = T.meta_var((io.kc, io.k16))
        qr, sc, mx, sacc = T.meta_var((scratch.qr, scratch.sc, scratch.mx, scratch.sacc))
        per = T.bind(tiles // T.int64(nt))
        for r in range(per + T.Cast("int64", tiles % T.int64(nt) > T.int64(0))):
            for gs in T.unroll(ng):
                for blk, dd in T.grid(blocks, block):   # line d of a tile: element d of its 16 keys
                    d = T.bind(blk * block + dd)
                    if gs == 0:   # each stream's line `ahead` on (past the tile: the next)
                        for i in T.unroll(nt):
                            first = T.bind((t0 + T.min(i * per + r, tiles - T.int64(1))) * T.int64(kt))
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(kc[
                                row, kvh, k_row_col(first, d + ahead, head_dim, width)[0],
                                k_row_col(first, d + ahead, head_dim, width)[1]]), T.int32(0), T.int32(3),
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
                        s = T.bind(T.Select(in_tile(T, t, keys), sacc[T.ramp((i * hg + hh) * kt, 1, kt)]
                                            * T.broadcast(T.float32(scale), kt), T.broadcast(T.float32(NEG_INF), kt)))
                        sc[h, T.ramp((t - t0) * kt, 1, kt)] = s
                        mx[T.ramp(h * kt, 1, kt)] = T.max(mx[T.ramp(h * kt, 1, kt)], s)
                        sacc[T.ramp((i * hg + hh) * kt, 1, kt)] = T.broadcast(T.float32(0), kt)

    @T.macro
    def weigh(scratch, keys, t0, tiles):
        """2: weights exp(s - max) in place of the scores (past the last key: 0); per head the
        max in top, the weights' sum in tot."""
        sc, mx, top, tot = T.meta_var((scratch.sc, scratch.mx, scratch.top, scratch.tot))
        for hh in range(g):
            top[hh] = vector_math.reduce_max(T, mx[T.ramp(hh * kt, 1, kt)], kt)
            mx[T.ramp(hh * kt, 1, kt)] = T.broadcast(T.float32(0), kt)    # now the sum's lanes
            for t in range(t0, t0 + tiles):
                e = T.bind(T.Select(in_tile(T, t, keys),
                                    vector_math.exp(T, sc[hh, T.ramp((t - t0) * kt, 1, kt)] - T.broadcast(top[hh], kt), kt),
                                    T.broadcast(T.float32(0), kt)))
                sc[hh, T.ramp((t - t0) * kt, 1, kt)] = e
                mx[T.ramp(hh * kt, 1, kt)] = mx[T.ramp(hh * kt, 1, kt)] + e
            tot[hh] = vector_math.reduce_sum(T, mx[T.ramp(hh * kt, 1, kt)], kt)

    @T.macro
    def values(io, scratch, row, kvh, k0, k1):
        """3: accs = the weighted sum of the values of keys k0 .. k1 per head, in blocks of vb
        keys: the block's V rows come from DRAM for its first tile of hv heads x dv dims
        (which prefetches the next block's) and from L1 for the others; a tile accumulates in
        registers (acc), between blocks in accs. Heads past the group redo the last one."""
        vc, v16 = T.meta_var((io.vc, io.v16))
        sc, acc, accs = T.meta_var((scratch.sc, scratch.acc, scratch.accs))
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
    def quantize_output(io, h0):
        """4 (with zero_point): the task's heads' output as Q8_0 blocks, from the stored output:
        the same bits as the quantizer kernel reading it."""
        out, aq, ad, off = T.meta_var((io.out, io.aq, io.ad, io.off))
        for hh in range(g):
            if quantize:
                for b in range(head_dim // BLOCK):
                    col = T.bind((h0 + hh) * head_dim + b * BLOCK)
                    quantize_block(T, out[T.int64(0), T.int64(0), T.ramp(col, 1, LANES)],
                                   out[T.int64(0), T.int64(0), T.ramp(col + LANES, 1, LANES)],
                                   aq, ad, off, T.int64(0), col // BLOCK, zero_point,
                                   None if layout == "plain" else ((lambda e, col=col: col + e), (col // BLOCK,)))

    @T.macro
    def merge(io, spans, h0, first, row, tok):
        """5 (keys in several spans): the task's heads' output from its spans' partial results
        (part rows first .. first + spans: per head its max, its weights' sum, its weighted
        values), each span's rescaled by exp(its max - the largest), as the online softmax
        does; then the Q8_0 blocks."""
        part, out = T.meta_var((io.part, io.out))
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
        quantize_output(io, h0)

    @T.macro
    def span_task(io, task, item, kvh, h0, span, write, slot):
        """One task: the heads h0 .. h0 + g of `item`, (row, tok, crow): token `tok` of row `row`
        of q, over `span`, (keys, t0, n, spans): tiles t0 .. t0 + n of its `keys` (one of its
        `spans`) in cache row `crow`, first writing its new key and value at `slot` where
        `write`; the output (one span) or the span's partial result in part[task]."""
        row, tok, crow = T.meta_var(item)
        keys, t0, n, spans = T.meta_var(span)
        cap, out, part = T.meta_var((io.cap, io.out, io.part))
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
        scratch = T.meta_var(_Scratch(sc, mx, top, tot, qr, sacc, acc, accs))
        if write:   # the span that holds the new token's slot
            write_new_token(io, kr, kvh, slot, row, tok)
        rotate_queries(io, qr, mx, h0, row, tok)
        score(io, scratch, crow, kvh, keys, t0, n)
        weigh(scratch, keys, t0, n)
        values(io, scratch, crow, kvh, t0 * T.int64(kt), T.min(keys, (t0 + n) * T.int64(kt)))
        if spans == T.int64(1):
            for hh in range(g):
                for c in T.unroll(chunks):
                    out[row, tok, T.ramp((h0 + hh) * head_dim + c * LANES, 1, LANES)] = (
                        accs[T.ramp(hh * head_dim + c * LANES, 1, LANES)] / T.broadcast(tot[hh], LANES))
            quantize_output(io, h0)
        else:
            for hh in range(g):
                part[task, hh, 0] = top[hh]
                part[task, hh, 1] = tot[hh]
                for c in T.unroll(chunks):
                    part[task, hh, T.ramp(2 + c * LANES, 1, LANES)] = accs[T.ramp(hh * head_dim + c * LANES, 1, LANES)]

    @T.macro
    def attend(call, seqlens):
        """The one new token: call's tensors (_Call, without the scale views and partial
        results, which this adds)."""
        kc, vc, cap = T.meta_var((call.kc, call.vc, call.cap))
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
        io = T.meta_var(call._replace(k16=k16, v16=v16, part=part))
        for task in T.parallel(kv_heads * subs * spans):
            kvh = T.bind(task // (subs * spans))
            h0 = T.bind(kvh * group + task // spans % subs * g)    # the task's first query head
            t0 = T.bind(task % spans * T.int64(span_tiles))        # the span's first tile
            n = T.bind(span_tile_count(T, tiles, t0))              # and its tiles
            span_task(io, task, (T.int64(0), T.int64(0), T.int64(0)), kvh, h0, (keys, t0, n, spans),
                      task % spans == spans - T.int64(1), slot)
        if spans > T.int64(1):
            for task in T.parallel(kv_heads * subs):
                merge(io, spans, task // subs * group + task % subs * g, task * spans, T.int64(0), T.int64(0))

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
    def attend_items(call, items, seqlens, segs):
        """`queries` (t tokens of row 0), `rows` (a token of each of B rows) or `segments` (a
        step's one-token segments): every item's new key and value written first (segments:
        the step's kernels wrote them), then each item's tasks as its own decode step's (its
        keys up to its slot)."""
        kc, vc, cap, pos = T.meta_var((call.kc, call.vc, call.cap, call.pos))
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
        io = T.meta_var(call._replace(k16=k16, v16=v16, part=part))
        if not segments:
            for kvh in T.parallel(kv_heads):   # every new key and value before any task reads them
                kr = T.decl_buffer((head_dim,), "float32", scope="global")
                for i in range(items):
                    write_new_token(io, kr, kvh, item_slot(i, seqlens, first, segs, pos), item(i, segs)[0],
                                    item(i, segs)[1])
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
                span_task(io, task, item(i, segs), kvh, h0, (keys, t0, n, own), False, None)
        if spans > T.int64(1):
            for task in T.parallel(items * kv_heads * subs):
                i = T.bind(task // (kv_heads * subs))
                own = T.bind(span_count(T, (item_slot(i, seqlens, first, segs, pos) + T.int64(kt)) // T.int64(kt)))
                if item_taken(i, segs) and own > T.int64(1):
                    # the group's spans are part rows task * spans .. (the loop above's task order)
                    merge(io, own, task % (kv_heads * subs) // subs * group + task % subs * g, task * spans,
                          item(i, segs)[0], item(i, segs)[1])

    @T.macro
    def kernel_body(handles, seqlens, pos, aq, ad, off, qg, kg):
        """One token: handles (q, k, v, kc, vc, cos, sin, out) matched to their buffers; qg, kg
        the head norm's gains (None without)."""
        # opaque: FuseOps leaves it whole; WRITES_Q8 tells the o projection its input is quantized
        T.func_attr({"tir.noalias": True, "op_pattern": 8, WRITES_Q8: quantize})
        var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out = T.meta_var(handles)
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
            attend(_Call(q, k, v, kc, vc, None, None, cap, pos, cos, sin, out,
                         T.decl_buffer((nb * BLOCK,), "int8", data=aq.data),
                         T.decl_buffer((nb,), "float32", data=ad.data),
                         T.decl_buffer((nb,), "int32", data=off.data), None, qg, kg), seqlens)
        else:
            attend(_Call(q, k, v, kc, vc, None, None, cap, pos, cos, sin, out, aq, ad, off, None, qg, kg), seqlens)

    @T.macro
    def items_body(handles, var_seqlens, var_pos, cap, positions, items, b, t, qg, kg):
        """`queries` / `rows`: q [b, t, ...] with b = 1, t = items or b = items, t = 1; handles
        (q, k, v, kc, vc, cos, sin, out) matched to their buffers; qg, kg as kernel_body's."""
        T.func_attr({"tir.noalias": True, "op_pattern": 8, WRITES_Q8: False})
        var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out = T.meta_var(handles)
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
        attend_items(_Call(q, k, v, kc, vc, None, None, cap, pos, cos, sin, out, None, None, None, None, qg, kg),
                     items, seqlens, None)

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
            attend_items(_Call(q, None, None, kc, vc, None, None, cap, pos, None, None, out, None, None, None, None),
                         count, None, segs)
        return hand_scheduled(kernel)

    if (rows or queries) and norm:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   var_seqlens: T.handle, var_pos: T.handle, var_cos: T.handle, var_sin: T.handle,
                   qg: T.Buffer((head_dim,), "float32"), kg: T.Buffer((head_dim,), "float32"), var_out: T.handle):
            cap, positions, items = T.int64(), T.int64(), T.int64()
            items_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), var_seqlens, var_pos, cap,
                       positions, items, items if rows else T.int64(1), T.int64(1) if rows else items, qg, kg)
        return hand_scheduled(kernel)

    if rows or queries:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   var_seqlens: T.handle, var_pos: T.handle, var_cos: T.handle, var_sin: T.handle,
                   var_out: T.handle):
            cap, positions, items = T.int64(), T.int64(), T.int64()
            items_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), var_seqlens, var_pos, cap,
                       positions, items, items if rows else T.int64(1), T.int64(1) if rows else items, None, None)
        return hand_scheduled(kernel)

    if quantize and norm:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
                   var_sin: T.handle, qg: T.Buffer((head_dim,), "float32"), kg: T.Buffer((head_dim,), "float32"),
                   var_out: T.handle, aq: T.Buffer((1, nb, BLOCK), "int8"), ad: T.Buffer((1, nb), "float32"),
                   off: T.Buffer((1, nb), "int32")):
            kernel_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), seqlens, pos, aq, ad, off,
                        qg, kg)
        return hand_scheduled(kernel)

    if quantize:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
                   var_sin: T.handle, var_out: T.handle, aq: T.Buffer((1, nb, BLOCK), "int8"),
                   ad: T.Buffer((1, nb), "float32"), off: T.Buffer((1, nb), "int32")):
            kernel_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), seqlens, pos, aq, ad, off,
                        None, None)
        return hand_scheduled(kernel)

    if norm:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
                   seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
                   var_sin: T.handle, qg: T.Buffer((head_dim,), "float32"), kg: T.Buffer((head_dim,), "float32"),
                   var_out: T.handle):
            kernel_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), seqlens, pos, None, None,
                        None, qg, kg)
        return hand_scheduled(kernel)

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_kc: T.handle, var_vc: T.handle,
               seqlens: T.Buffer((1,), "int32"), pos: T.Buffer((1, 1), pos_dtype), var_cos: T.handle,
               var_sin: T.handle, var_out: T.handle):
        kernel_body((var_q, var_k, var_v, var_kc, var_vc, var_cos, var_sin, var_out), seqlens, pos, None, None, None,
                    None, None)
    return hand_scheduled(kernel)
