"""W4A8 Q4_0 matmul with AVX-512 VNNI `vpdpbusd`, one 32-bit lane per output row.

The weights come in the row-group layout (kernels/row_groups.py), so a 512-bit chunk holds 4
bytes of each of 16 rows: with one 4-byte activation group broadcast to every lane (an
embedded-broadcast memory operand), one vpdpbusd advances the 16 rows by 4 weights. A block is
8 vpdpbusd per token and group; its int32 lanes are then the 16 rows' block dots: one convert
and one FMA with the 16 rows' scales, no horizontal sums, and a contiguous 16-float store.

vpdpbusd multiplies unsigned by signed bytes: the nibbles q (0..15) are the unsigned operand as
they are, and dot(q - 8, a) = dot(q, a) - 8 * sum(a); the quantizer supplies -8 * sum(a) per
block, which starts the accumulation.

Prefill runs tiles of `tokens` tokens over a group, so each unpacked weight vector serves all
of them and the group's weights (nb x 256 bytes: 39 KiB at K = 4864) stay in L1/L2. This
replaced a two-rows-per-vector form with a horizontal sum per row, faster in prefill and
on decode for the 0.5B shape (docs/design.md).

Five-bit codes (a GGUF's Q5_0 / Q5_1 / Q5_K: dot "vnni5", row_groups.pack_five_bit) run on the
same kernels too: each chunk of codes is rebuilt from a nibble chunk and the chunk of fifth
bits (_codes); its sums start as Q4_0's, and its block offsets (with Q4_K's compact scales
where the file's factors come back) add the rest.

Q8_0 weights run as W8A8 (dot "vnni8") on the same kernels: eight chunks a block of the codes
u = q + 128 (row_groups.pack_int8, unsigned: vpdpbusd's unsigned operand as they are), so
dot(q, a) = dot(u, a) - 128 x sum(a), which is 16 x the quantizer's offset: the accumulation
starts there, and a block is 8 vpdpbusd with nothing unpacked. AVX2 has no such form (its
vpmaddubsw pair sums of u x a overflow int16); there Q8_0 runs as two 4-bit halves
(compiler/repack.py).

A GGUF's IQ4_NL / IQ4_XS (dot "vnni_iq4": kernels/code_book.py) keep Q4_0's nibbles as 4-bit
indices, each chunk made the codes u = book[q] + 128 by one vpshufb; their sums start as Q8_0's.
"""

from __future__ import annotations

from .. import DECODE_GEMV, DECODE_PREFETCH, SCHEDULED, code_book, dot_bits, q4_k_scales, task_claims
from ..kernel_cache import cached_kernel
from ..row_groups import ROWS, chunks, groups
from ..w4a8 import block_sum_factor, gemm_kernel, store_rows, token_count

# Tokens per prefill tile, the hand value (`qwc tune` searches targets.W4A8.prefill_tokens).
# A tile's block costs 8 vpdpbusd a token plus the per-token add, convert, scale and FMA (12
# vector uops), and its unpacking (4 and + 4 shifts, the scales' convert: 10) once: 8 tokens
# take that share from 2.5 uops a token to 1.25. AVX-512's 32 registers hold the 8 sums, the 8
# unpacked vectors and the int32 chains (no spills), and 8 beat 4 (bench/prefill_gemm.py,
# docs/history/x86-speed.md). AVX2's 16 registers keep 4. With a token's sums in two chains
# (q4_matmul: accumulate) 7-token tiles were level with 8 on long prompts and slower on short
# ones (more tiles for the same tokens): 8 stay.
DEFAULT_TOKENS = {"vnni": 8, "avx2": 4, "vnni8": 8, "vnni5": 8, "vnni_iq4": 8}
DECODE_EPILOGUES = frozenset({"bias", "silu_mul", "quantize"})   # decode_gemv's
PREFILL_BIAS = True   # prefill_gemm(..., bias=True): the bias added as the rows are stored

# Decode prefetches the weights 4 blocks (1 KiB) ahead into L1, in each of its STREAMS
# streams. A GEMV's weights always come from DRAM, and the hardware streamer stops at every
# 4 KiB page and restarts slowly. With one stream a thread a far L2 prefetch kept misses in
# flight across those restarts. With four streams (below) whose restarts fall at different
# times it no longer pays: L1 at 4 blocks alone decodes faster than 8 blocks into L1 plus 32
# into L2, and 2 blocks is slower; non-temporal prefetches, and prefetching the scale stream
# too, were slower still (docs/design.md, docs/history/x86-speed.md).
PREFETCH = ((4, 3),)   # (blocks ahead, LLVM locality: 3 = L1, 2 = L2)
# Decode reads STREAMS far-apart row groups in lockstep, block by block: each thread then has
# STREAMS sequential streams in flight whose page crossings fall at different times, so one
# restarting stream no longer idles the memory pipe. Weight GB/s in a decode-like stream of
# distinct weights: 4864x896 28 -> 31, 896x4864 27 -> 30, lm_head 32 -> 35; 8 streams were
# slower (docs/design.md). A plain read of memory gains the same way (bench/gemv.py).
STREAMS = 4
def _block_dot(T, w, aq, off, g, b, t, dot: str = "vnni"):
    """int32x16: the 16 rows' dot(q - 8, a) for block b and token t, as one expression (named
    temporaries would become per-thread allocations inside the parallel loop): decode's one
    token. Two chains (low and high nibbles) halve the dependent vpdpbusd latency; the GEMMs'
    tokens are their independent chains (q4_matmul: accumulate). `dot` "avx2": the same sums
    from AVX2's vpmaddubsw + vpmaddwd on each 256-bit half (rows 0-7, 8-15)."""
    if dot == "avx2":
        return _block_dot_avx2(T, w, aq, off, g, b, t)
    dp = "llvm.x86.avx512.vpdpbusd.512"
    lo = T.broadcast(_start(T, off, t, b, dot), 16)
    hi = T.broadcast(T.int32(0), 16)
    for i in range(4):
        lo = T.call_llvm_pure_intrin("int32x16", dp, lo, _codes(T, w, g, b, i, False, dot), _act(T, aq, t, b, i))
        hi = T.call_llvm_pure_intrin("int32x16", dp, hi, _codes(T, w, g, b, i, True, dot), _act(T, aq, t, b, 4 + i))
    return lo + hi


def _start(T, off, t, b, dot: str):
    """int32: where token t's block b sums start. Q4_0 (and five-bit codes, whose block offsets
    carry the rest: compiler/repack_five_bit.py): the quantizer's -8 x sum(a), an int32 from
    memory (a broadcast load, no ALU work); Q8_0's u = q + 128 and the book's codes: 16 times that."""
    return off[t, b] * T.int32(16) if dot_bits(dot) == 8 or code_book.reads_book(dot) else off[t, b]


def _codes(T, w, g, b, i, high: bool, dot: str):
    """uint8x64: the 16 rows' codes of block b that meet activation bytes 4j..4j+3, j = i (+ 4
    if `high`): Q4_0's chunk i, its low or high nibbles; Q8_0's chunk j, as it is; five-bit
    codes' chunk j, its four low bits from chunk i's low or high nibbles and its fifth from bit j
    of chunk 4 (row_groups.pack_five_bit), moved to bit 4: a shift, and one and-or; 4-bit
    indices (code_book) looked up in the book, the codes book[q] + 128."""
    bits = dot_bits(dot)
    if code_book.reads_book(dot):
        nibbles = _codes(T, w, g, b, i, high, "vnni")
        return T.call_llvm_pure_intrin("uint8x64", "llvm.x86.avx512.pshuf.b.512", code_book.table(T, 64, 128), nibbles)
    if bits == 8:
        return w.vload([g, b, i + 4 if high else i, 0], "uint8x64")
    if bits == 5:
        j = i + 4 if high else i   # (a loop variable in the tiles, unrolled: LLVM folds the shifts)
        fifth = (w.vload([g, b, 4, 0], "uint8x64") >> T.broadcast(T.Cast("uint8", j), 64)) & T.broadcast(T.uint8(1), 64)
        low = (w.vload([g, b, i, 0], "uint8x64") >> T.broadcast(T.uint8(4), 64) if high
               else w.vload([g, b, i, 0], "uint8x64") & T.broadcast(T.uint8(15), 64))
        return low | (fifth << T.broadcast(T.uint8(4), 64))
    if high:
        return w.vload([g, b, i, 0], "uint8x64") >> T.broadcast(T.uint8(4), 64)
    return w.vload([g, b, i, 0], "uint8x64") & T.broadcast(T.uint8(15), 64)


def _act(T, aq, t, b, j):
    """int8x64: activation bytes 4j..4j+3 of token t, block b, in every lane."""
    return T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", aq.vload([t, b, 4 * j], "int8x4")), 16))


def _block_dot_avx2(T, w, aq, off, g, b, t):
    """vpdpbusd without VNNI: vpmaddubsw multiplies the unsigned nibbles by the signed
    activation bytes and adds adjacent pairs into int16 lanes (at most 2 x 15 x 128 = 3840), so
    the block's 8 products of a row half fit one int16 sum (at most 30720 < 32767: vpaddw
    without widening); one vpmaddwd by ones then adds each row's two int16 lanes into its
    int32 lane. A 512-bit chunk of the row-group layout is two 256-bit halves of 8 rows each;
    the halves' int32x8 sums are joined into the int32x16 the callers take."""
    ubsw, wd = "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"

    def act(j):   # activation bytes 4j..4j+3 in every lane of a half
        return T.reinterpret("int8x32", T.broadcast(T.reinterpret("int32", aq.vload([t, b, 4 * j], "int8x4")), 8))

    halves = []
    for h in range(2):
        s16 = None
        for i in range(4):
            chunk = w.vload([g, b, i, 32 * h], "uint8x32")
            for q, j in ((chunk & T.broadcast(T.uint8(15), 32), i), (chunk >> T.broadcast(T.uint8(4), 32), 4 + i)):
                p = T.call_llvm_pure_intrin("int16x16", ubsw, q, act(j))
                s16 = p if s16 is None else s16 + p
        halves.append(T.call_llvm_pure_intrin("int32x8", wd, s16, T.broadcast(T.int16(1), 16))
                      + T.broadcast(off[t, b], 8))
    return T.Shuffle(halves, list(range(16)))


def _offsets_term(T, ws, wc, ad, off, g, b, t):
    """float32x16: Q4_1's block offsets of the 16 rows times the activations' block sum (scale x
    sum of the codes, from the quantizer's offset): the minimum's term, one FMA a block. Q4_K's
    compact scales make the offsets from their factors (kernels/q4_k_scales.py)."""
    c = (q4_k_scales.offsets(T, ws, wc, g, b, 0, ROWS) if ws.dtype == q4_k_scales.SCALE_DTYPE
         else wc.vload([g, b, 0], "float32x16"))
    return c * T.broadcast(ad[t, b] * T.Cast("float32", off[t, b]) * T.float32(block_sum_factor()), ROWS)


def _scales(T, ws, wc, g, b):
    """The 16 rows' fp32 scales of group g, block b (Q4_K's compact ones: d sc from wc's d)."""
    if ws.dtype == q4_k_scales.SCALE_DTYPE:
        return q4_k_scales.scales(T, ws, wc, g, b, 0, ROWS)
    if ws.dtype == "float16":
        return T.Cast("float32x16", ws.vload([g, b, 0], "float16x16"))
    return ws.vload([g, b, 0], "float32x16")


# The batched decode step (one token of each of B <= 16 sequences) reads every weight from
# DRAM, as decode does, for a few tokens: its GEMM takes 8-token tiles that prefetch as
# decode_gemv does (PREFETCH; past a group's last block into the next group's first) and the
# leftover tokens in tiles of 4, 2 and 1 without prefetch (where a prefetch cost more than it
# hid). It beat the prefill form (4-token tiles, leftovers one at a time) at every batch size
# (bench/decode_step.py; docs/history/serving.md).
BATCHED_DECODE_TOKENS = 8

# A few tokens (a batched decode step of few sequences, a speculative verify call, a short
# prompt) read every weight once from DRAM for little arithmetic: memory-bound like decode, so
# they take decode's streams (decode_gemv: far-apart row groups in lockstep, each prefetched
# into L1) rather than tiles that read one group after another. A stream holds a 16-row
# accumulator a token, so fewer streams at more tokens: FEW_STREAMS[M - 1], each entry the
# fastest count measured on the 0.5B shape for AVX-512 VNNI and for AVX2 (whose 16-row
# accumulator is two of its 16 registers), against each other and against 8-token tiles
# (docs/history/serving.md, "Few tokens in decode's streams").
# With 8-token tiles and int32 offsets a block's arithmetic at 5-8 tokens takes as long as its
# weights take to arrive, and decode's 4 blocks ahead no longer hid that: AVX-512 prefetches
# FEW_AHEAD blocks ahead a thread, over its streams (4 streams: 4 each, as decode); then one
# stream beat two at M = 5, and two were only level with four at M = 4, so four stay there.
# AVX2's counts (not measured on an AVX2 machine since) stay.
FEW_STREAMS = {"vnni": (4, 4, 4, 4, 1, 1, 1, 1), "vnni8": (4, 4, 4, 4, 2, 1, 1, 1), "avx2": (4, 4, 4, 4, 2, 1, 1, 1),
               "vnni5": (4, 4, 4, 4, 1, 1, 1, 1), "vnni_iq4": (4, 4, 4, 4, 1, 1, 1, 1)}   # (vnni's, not measured apart)
FEW_TOKENS = len(FEW_STREAMS["vnni"])
FEW_AHEAD = {"vnni": 16, "vnni8": 16, "vnni5": 16, "vnni_iq4": 16}

# Prefill reads a row group's weights from DRAM in its first tile and from L1 in the others;
# that first tile prefetches the weights and scales of the group NEXT_GROUP on (the thread's
# next but one) into L2. 4864 x 896 at 136 tokens on 120 distinct weights (266 MB, past the
# L3), 2 threads, Intel Xeon: 339-347 -> 372-373 GMAC/s (1 group on, weights only: 359-362).
NEXT_GROUP = 2


def few_ahead(dot: str, streams: int) -> int:
    """Blocks a stream of the few-token forms prefetches ahead (AVX2: decode's PREFETCH each)."""
    return FEW_AHEAD[dot] // streams if dot in FEW_AHEAD else PREFETCH[0][0]


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q4_matmul(n: int, nb: int, scale_dtype: str = "float16", tokens: int | None = None, m: int | None = None,
              batched_decode: bool = False, dot: str = "vnni", offsets: bool = False, bias: bool = False,
              amx: bool = False):
    """Prefill: y [M, N] from the de-interleaved int8 activations (aq, their scales ad, the
    -8 x sum offsets) and the packed weights, in tiles of `tokens` tokens per row group and
    leftovers one at a time. M is any number of tokens, or `m` (tuning measures at fixed M).
    `batched_decode`: the form for decode_batch (BATCHED_DECODE_TOKENS above; `tokens` unused).
    `dot`: "vnni" (AVX-512 VNNI), "avx2" (_block_dot) or "vnni8" (Q8_0 weights). `offsets`:
    with Q4_1's block offsets (w4a8.gemm_kernel); `bias`: adds a bias [N] as it stores (the
    q, k and v projections': an add kernel of their own a launch each, 72 a step at 24 layers).
    `amx`: prefill's tiles of 16 tokens on AMX (x86/amx.py), the leftover tokens on VNNI's."""
    from tvm.script import tirx as T

    from . import amx as amx_tiles

    ng = groups(n)
    amx = amx and not batched_decode
    # (with AMX the VNNI tiles take only the last 8-15 tokens, in 8 and the set bits below)
    tm = BATCHED_DECODE_TOKENS if batched_decode else DEFAULT_TOKENS[dot] if amx else tokens or DEFAULT_TOKENS[dot]
    rows_in = token_count(m)
    locality = PREFETCH[0][1]

    @T.macro
    def accumulate(w, aq, off, ws, ad, wc, acc, dots, highs, at, g, b, first, count):
        """acc[16 (at + t) ..] += block b's term for rows 16g .. 16g+15 and token first + t, t <
        count. VNNI: each code chunk's vpdpbusd for every token before the next chunk's, a
        token's low codes into `dots` (started at its offset) and its high codes into `highs`,
        joined by one add: 2 x count independent chains of 4 (the tiles); without `highs` (the
        few-token forms) all into `dots`, count chains of 8.
        A token's chains one after the other left the out-of-order window waiting on their
        latency: 4864 x 896 at 136 tokens, 2 threads, Intel Xeon, 350-355 -> 399-411 GMAC/s
        (with NEXT_GROUP; Q8_0 332-336 -> 391; the few-token forms at M = 4 / 8 211 -> 239 /
        349 -> 356). One chain of 8 a token (no joining add) was still latency-bound in the
        tiles: two of 4 take less of its time at 9-200 tokens (4864 x 896 and 896 x 4864;
        Q8_0 from 64 tokens). The few-token forms, bound by their weights' arrival,
        were level or slower, so they keep one. The integer sums are exact in
        any order: the same bits. AVX2 a token at a time (_block_dot)."""
        if dot == "avx2":   # decided when the kernel is built
            for t in T.unroll(count):
                acc[T.ramp((at + t) * ROWS, 1, ROWS)] = acc[T.ramp((at + t) * ROWS, 1, ROWS)] + T.Cast(
                    "float32x16", _block_dot(T, w, aq, off, g, b, first + t, dot)) * (
                    _scales(T, ws, wc, g, b) * T.broadcast(ad[first + t, b], ROWS))
        else:
            for t in T.unroll(count):
                dots[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(_start(T, off, first + t, b, dot), ROWS)
                if highs is not None:   # decided when the kernel is built (the tiles)
                    highs[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.int32(0), ROWS)
            if highs is not None:
                for i in T.unroll(4):
                    for t in T.unroll(count):
                        dots[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                            "int32x16", "llvm.x86.avx512.vpdpbusd.512", dots[T.ramp(t * ROWS, 1, ROWS)],
                            _codes(T, w, g, b, i, False, dot), _act(T, aq, first + t, b, i))
                        highs[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                            "int32x16", "llvm.x86.avx512.vpdpbusd.512", highs[T.ramp(t * ROWS, 1, ROWS)],
                            _codes(T, w, g, b, i, True, dot), _act(T, aq, first + t, b, 4 + i))
            else:   # the few-token forms (streamed): one chain of 8 a token, low codes first
                for i in T.unroll(4):
                    for t in T.unroll(count):
                        dots[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                            "int32x16", "llvm.x86.avx512.vpdpbusd.512", dots[T.ramp(t * ROWS, 1, ROWS)],
                            _codes(T, w, g, b, i, False, dot), _act(T, aq, first + t, b, i))
                for i in T.unroll(4):
                    for t in T.unroll(count):
                        dots[T.ramp(t * ROWS, 1, ROWS)] = T.call_llvm_pure_intrin(
                            "int32x16", "llvm.x86.avx512.vpdpbusd.512", dots[T.ramp(t * ROWS, 1, ROWS)],
                            _codes(T, w, g, b, i, True, dot), _act(T, aq, first + t, b, 4 + i))
            for t in T.unroll(count):
                acc[T.ramp((at + t) * ROWS, 1, ROWS)] = acc[T.ramp((at + t) * ROWS, 1, ROWS)] + T.Cast(
                    "float32x16", dots[T.ramp(t * ROWS, 1, ROWS)] if highs is None else
                    dots[T.ramp(t * ROWS, 1, ROWS)] + highs[T.ramp(t * ROWS, 1, ROWS)]) * (
                    _scales(T, ws, wc, g, b) * T.broadcast(ad[first + t, b], ROWS))
        if wc is not None:   # decided when the kernel is built
            for t in T.unroll(count):
                acc[T.ramp((at + t) * ROWS, 1, ROWS)] = acc[T.ramp((at + t) * ROWS, 1, ROWS)] + _offsets_term(
                    T, ws, wc, ad, off, g, b, first + t)

    @T.macro
    def tile(w, aq, off, ws, ad, y, wc, bias, g, first, count, prefetch, next_group):
        """Rows 16g .. 16g+15 of tokens first .. first+count-1. `prefetch`: this group's
        weights ahead into L1 (batched decode: from DRAM); `next_group`: those of group g +
        NEXT_GROUP into L2 (prefill's first tile of a group; its later tiles find this group's
        weights in L1)."""
        # "global", not "local": TVM places small constant-size global allocations on the stack
        # (LLVM then keeps them in registers) but serves every "local" one with a
        # TVMBackendAllocWorkspace call, here once per 16-row group.
        acc = T.decl_buffer((count * ROWS,), "float32", scope="global")
        # two buffers, not one of both: TVM puts a constant-size buffer on the stack only below
        # 1 KiB, and with one of 1 KiB (8 tokens) every vpdpbusd went through memory
        dots = T.decl_buffer((count * ROWS,), "int32", scope="global")
        highs = T.decl_buffer((count * ROWS,), "int32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        for b in range(nb):
            if prefetch:   # decided when the kernel is built
                for i in T.unroll(chunks(dot_bits(dot))):
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g, b + few_ahead(dot, 1), i, 0]),
                                                  T.int32(0), T.int32(locality), T.int32(1)))
            if next_group:   # (past the last group: a prefetch does not fault)
                for i in T.unroll(chunks(dot_bits(dot))):
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g + NEXT_GROUP, b, i, 0]),
                                                  T.int32(0), T.int32(2), T.int32(1)))
                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(ws[g + NEXT_GROUP, b, 0]),
                                              T.int32(0), T.int32(2), T.int32(1)))
            accumulate(w, aq, off, ws, ad, wc, acc, dots, highs, 0, g, b, first, count)
        for t in T.unroll(count):
            store_rows(y, first + t, g * ROWS, ROWS, n, acc, t * ROWS, None, bias)

    configure, make_b, amx_blocks = amx_tiles.macros(
        T, nb, dot, lambda w, g, b, i, high: _codes(T, w, g, b, i, high, dot),
        lambda ws, wc, g, b: _scales(T, ws, wc, g, b))

    @T.macro
    def amx_tile(w, aq, ws, ad, y, wc, bias, bt, cs, sums, g, first, next_group):
        """Rows 16g .. 16g+15 of tokens first .. first+15 on AMX; `next_group` as in tile."""
        lo = T.decl_buffer((8 * ROWS,), "float32", scope="global")   # a stack slot each: see tile
        hi = T.decl_buffer((8 * ROWS,), "float32", scope="global")
        for t in T.unroll(8):
            lo[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
            hi[T.ramp(t * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        if next_group:   # (past the last group: a prefetch does not fault)
            for b in range(nb):
                for i in T.unroll(chunks(dot_bits(dot))):
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g + NEXT_GROUP, b, i, 0]),
                                                  T.int32(0), T.int32(2), T.int32(1)))
        amx_blocks(aq, ws, ad, wc, sums, lo, hi, bt, cs, g, first)
        for t in T.unroll(8):
            store_rows(y, first + t, g * ROWS, ROWS, n, lo, t * ROWS, None, bias)
            store_rows(y, first + 8 + t, g * ROWS, ROWS, n, hi, t * ROWS, None, bias)

    @T.macro
    def amx_tiles_of(w, aq, off, ws, ad, y, wc, bias, g, sums):
        """Row group g's whole 16-token tiles on AMX, then at most one 8-token VNNI tile: what
        is left is under 8 tokens, group_tiles' leftovers."""
        if rows_in >= amx_tiles.TOKENS:
            cfg = T.decl_buffer((64,), "uint8", scope="global")
            bt = T.decl_buffer((nb, amx_tiles.BLOCK * ROWS), "uint8", scope="global")
            cs = T.decl_buffer((amx_tiles.SLOTS, amx_tiles.TOKENS * ROWS), "int32", scope="global")
            configure(cfg)
            make_b(w, bt, g)
            amx_tile(w, aq, ws, ad, y, wc, bias, bt, cs, sums, g, 0, True)
            for it in range(1, rows_in // amx_tiles.TOKENS):
                amx_tile(w, aq, ws, ad, y, wc, bias, bt, cs, sums, g, it * amx_tiles.TOKENS, False)
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))
        if rows_in % amx_tiles.TOKENS >= tm:
            tile(w, aq, off, ws, ad, y, wc, bias, g, rows_in // amx_tiles.TOKENS * amx_tiles.TOKENS, tm, False, False)

    def _tasks(streams):
        """streamed's tasks: a group of each stream, and the leftover groups as one more."""
        return ng // streams + (1 if ng % streams else 0)

    @T.macro
    def stream_task(w, aq, off, ws, ad, y, wc, bias, count, streams, task):
        """streamed's task `task`."""
        if task < ng // streams:
            acc = T.decl_buffer((streams * count * ROWS,), "float32", scope="global")
            dots = T.decl_buffer((count * ROWS,), "int32", scope="global")
            for i in T.unroll(streams * count):
                acc[T.ramp(i * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
            for b in range(nb):
                for h in T.unroll(streams):
                    for i in T.unroll(chunks(dot_bits(dot))):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                                      T.address_of(w[h * (ng // streams) + task, b + few_ahead(dot, streams), i, 0]),
                                                      T.int32(0), T.int32(locality), T.int32(1)))
                for h in T.unroll(streams):
                    accumulate(w, aq, off, ws, ad, wc, acc, dots, None, h * count, h * (ng // streams) + task, b, 0, count)
            for h in T.unroll(streams):
                for t in T.unroll(count):
                    store_rows(y, t, (h * (ng // streams) + task) * ROWS, ROWS, n, acc, (h * count + t) * ROWS, None,
                               bias)
        else:
            for g in range(ng // streams * streams, ng):
                tile(w, aq, off, ws, ad, y, wc, bias, g, 0, count, True, False)

    @T.macro
    def streamed(w, aq, off, ws, ad, y, wc, bias, count, streams):
        """All M = `count` tokens at once (FEW_STREAMS): with per = ng // streams, task i reads
        groups i, per + i, 2 per + i, ... in lockstep, block by block, prefetching ahead (past a
        group's last block into the stream's next group, the thread's next task); the groups
        left over (the ragged last one among them) are one more task, in a prefetching tile.
        The tasks go to the threads as they come for them (task_claims.py)."""
        flags = T.decl_buffer((_tasks(streams) + 1,), "int32", scope="global")
        for i in range(_tasks(streams) + 1):
            flags[i] = 0
        with T.attr(0, task_claims.PRAGMA, task_claims.IR):
            for slot in T.parallel(_tasks(streams)):
                if task_claims.seen(T, flags, _tasks(streams)) == 0:
                    for k in range(_tasks(streams)):
                        # (an expression, not a variable: one assigned in a loop becomes a buffer)
                        if task_claims.take(T, flags, task_claims.nth(slot, k, _tasks(streams))) == 1:
                            stream_task(w, aq, off, ws, ad, y, wc, bias, count, streams, task_claims.nth(slot, k, _tasks(streams)))
                    T.evaluate(task_claims.set_done(T, flags, _tasks(streams)))

    @T.macro
    def group_tiles(w, aq, off, ws, ad, y, wc, bias, g, sums):
        """Every token of row group g: tiles of tm tokens, then the leftovers (`sums`: see
        tiled)."""
        if batched_decode:   # decided when the kernel is built
            for it in range(rows_in // tm):
                tile(w, aq, off, ws, ad, y, wc, bias, g, it * tm, tm, True, False)
        elif amx:
            amx_tiles_of(w, aq, off, ws, ad, y, wc, bias, g, sums)
        elif rows_in >= tm:
            tile(w, aq, off, ws, ad, y, wc, bias, g, 0, tm, False, True)
            for it in range(1, rows_in // tm):
                tile(w, aq, off, ws, ad, y, wc, bias, g, it * tm, tm, False, False)
        if tm == 8:  # decided when the kernel is built (batched decode's tiles, AVX-512 prefill's)
            # the r = M mod 8 leftover tokens: one tile per set bit of r, largest first (one
            # tile of r, a copy of the tile per r, was barely faster and made compiles
            # markedly longer)
            if (rows_in % tm) // 4 % 2 == 1:
                tile(w, aq, off, ws, ad, y, wc, bias, g, rows_in // tm * tm, 4, False, False)
            if (rows_in % tm) // 2 % 2 == 1:
                tile(w, aq, off, ws, ad, y, wc, bias, g, rows_in // tm * tm + (rows_in % tm) // 4 * 4, 2, False,
                     False)
            if (rows_in % tm) % 2 == 1:
                tile(w, aq, off, ws, ad, y, wc, bias, g, rows_in // tm * tm + (rows_in % tm) // 2 * 2, 1, False,
                     False)
        elif tm > 1:
            for i in range(rows_in // tm * tm, rows_in):
                tile(w, aq, off, ws, ad, y, wc, bias, g, i, 1, False, False)

    @T.macro
    def groups_of(w, aq, off, ws, ad, y, wc, bias, sums):
        for g in T.parallel(ng):
            if scale_dtype == q4_k_scales.SCALE_DTYPE:   # decided when the kernel is built
                # Q4_K's compact scales made once a group into float32 scales and offsets, which
                # every tile then reads as the expanded form's: made once a tile, they cost the
                # GEMM more time (bench/q4_k.py). Views shaped as the weights' groups,
                # offset so that group g's entries are this task's copy.
                made = T.decl_buffer((2 * nb * ROWS,), "float32", scope="global")
                es = T.decl_buffer((ng, nb, ROWS), "float32", data=made.data, elem_offset=-g * (nb * ROWS))
                ec = T.decl_buffer((ng, nb, ROWS), "float32", data=made.data, elem_offset=(1 - g) * (nb * ROWS))
                for b in range(nb):
                    es[g, b, T.ramp(0, 1, ROWS)] = q4_k_scales.scales(T, ws, wc, g, b, 0, ROWS)
                    ec[g, b, T.ramp(0, 1, ROWS)] = q4_k_scales.offsets(T, ws, wc, g, b, 0, ROWS)
                group_tiles(w, aq, off, es, ad, y, ec, bias, g, sums)
            else:
                group_tiles(w, aq, off, ws, ad, y, wc, bias, g, sums)

    @T.macro
    def tiled(w, aq, off, ws, ad, y, wc, bias):
        if amx and wc is not None:   # decided when the kernel is built
            # The activations' block sums times their scales (what the block offsets multiply),
            # made once for every row group's AMX tiles: in their epilogue each was 5 scalar
            # and broadcast instructions a token and block, as many as the scaling of the dots.
            sums = T.decl_buffer((rows_in, nb), "float32")
            if rows_in >= amx_tiles.TOKENS:
                for t in T.parallel(rows_in):
                    for b in range(nb):
                        sums[t, b] = ad[t, b] * T.Cast("float32", off[t, b]) * T.float32(block_sum_factor())
            groups_of(w, aq, off, ws, ad, y, wc, bias, sums)
        else:
            groups_of(w, aq, off, ws, ad, y, wc, bias, None)

    @T.macro
    def body(w, aq, off, ws, ad, y, wc, bias):
        if m is None and rows_in <= FEW_TOKENS:   # (a fixed M is `qwc tune` measuring tiles)
            if rows_in == 1:
                streamed(w, aq, off, ws, ad, y, wc, bias, 1, FEW_STREAMS[dot][0])
            elif rows_in == 2:
                streamed(w, aq, off, ws, ad, y, wc, bias, 2, FEW_STREAMS[dot][1])
            elif rows_in == 3:
                streamed(w, aq, off, ws, ad, y, wc, bias, 3, FEW_STREAMS[dot][2])
            elif rows_in == 4:
                streamed(w, aq, off, ws, ad, y, wc, bias, 4, FEW_STREAMS[dot][3])
            elif rows_in == 5:
                streamed(w, aq, off, ws, ad, y, wc, bias, 5, FEW_STREAMS[dot][4])
            elif rows_in == 6:
                streamed(w, aq, off, ws, ad, y, wc, bias, 6, FEW_STREAMS[dot][5])
            elif rows_in == 7:
                streamed(w, aq, off, ws, ad, y, wc, bias, 7, FEW_STREAMS[dot][6])
            else:
                streamed(w, aq, off, ws, ad, y, wc, bias, 8, FEW_STREAMS[dot][7])
        else:
            tiled(w, aq, off, ws, ad, y, wc, bias)

    @T.macro
    def body_plain(w, aq, off, ws, ad, y, wc):
        body(w, aq, off, ws, ad, y, wc, None)

    return gemm_kernel(n, nb, scale_dtype, rows_in, body if bias else body_plain, chunks=chunks(dot_bits(dot)),
                       offsets=offsets, bias=bias)


def prefill_gemm(n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
                 batched_decode: bool = False, dot: str = "vnni", offsets: bool = False, bias: bool = False,
                 amx: bool = False):
    """The registry's prefill GEMM (kernels/w4a8.py): q4_matmul."""
    return q4_matmul(n, nb, scale_dtype, tokens=tokens, m=m, batched_decode=batched_decode, dot=dot, offsets=offsets,
                     bias=bias, amx=amx)


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def decode_gemv(outputs: tuple[tuple[int, bool, bool], ...], nb: int, scale_dtype: str = "float16",
                silu_mul: bool = False, quantize: int | None = None, dot: str = "vnni", prefetch: str = "software"):
    """Decode: one token through several weights that read the same activations (q, k and v;
    gate and up) in one parallel launch: outputs = ((N, with bias, with block offsets), ...).
    Arguments: aq, ad, off [1, ...] as for q4_matmul, then per output its packed weights,
    scales, Q4_1's block offsets if it has them and bias [N] if it has one, then the outputs
    y [1, N] in order (compiler/sibling_gemvs.py merges them).
    `silu_mul`: two outputs (gate, up) of one N, written as the one output silu(gate) * up
    [1, N] (the MLP's hidden state: no kernel of its own, the gate and up never stored).
    `quantize` (with `silu_mul`, N a multiple of 32): instead of y, the Q8_0 of the hidden
    state as kernels/act_quant.py's quantizer gives it with this zero point (aq [1, N/32, 32],
    ad and off [1, N/32]), the down projection's input: the quantizer's kernel is gone.

    Output i's full row groups form STREAMS streams of `per` groups; its tasks 0 .. per-1
    read groups p, per + p, 2 per + p, ... in lockstep, block by block, and past a group's
    last block the prefetch reaches that stream's next group (p + 1), read next. The groups
    left over (fewer than STREAMS full ones, and a ragged last one) are one more task. With
    `silu_mul` a task reads the same groups of gate and up (STREAMS / 2 streams each); with
    `quantize` those are the adjacent groups 2t and 2t + 1, so task t holds the 32 rows of
    block t whole and quantizes it, and a stream's prefetch past its group reaches group
    + 2. `prefetch` "hardware" (targets.IntDots.decode_prefetch): no prefetch instruction, and
    `quantize`'s groups 2t and 2t + 1 read in turn, as an AMD Zen's prefetchers stream them best
    (hidden_halves); the same bits. TVM's IR builder: TVMScript signatures cannot vary in length."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from .. import vector_math
    from ..act_quant import BLOCK, quantize_block

    if silu_mul and (len(outputs) != 2 or outputs[0][0] != outputs[1][0] or any(o[1] for o in outputs)):
        raise ValueError(f"silu_mul takes gate and up of one N without biases, got {outputs}")
    if quantize is not None and not (silu_mul and outputs[0][0] % BLOCK == 0):
        raise ValueError(f"quantize takes silu_mul outputs of an N that is a multiple of {BLOCK}, got {outputs}")
    if quantize is not None and STREAMS // 2 * ROWS != BLOCK:
        # a task's groups of gate (and of up) must be one 32-row block: with other STREAMS the
        # tasks' groups would overlap or leave gaps (wrong output, found by patching STREAMS)
        raise ValueError(f"quantize needs STREAMS / 2 row groups of {ROWS} to make a block of {BLOCK}, STREAMS is {STREAMS}")
    step = 2 if quantize is not None else 1   # a stream's next group

    ahead_of_use = PREFETCH if prefetch == "software" else ()

    def prefetch_ahead(w, g, b):
        for ahead, locality in ahead_of_use:
            # past the group's last block: the stream's next group (`step` groups on)
            blk = b + ahead if step == 1 else b + ahead + T.if_then_else(b + ahead >= nb, (step - 1) * nb, 0)
            for i in range(chunks(dot_bits(dot))):
                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g, blk, i, 0]),
                                              T.int32(0), T.int32(locality), T.int32(1)))   # read, data

    def accumulate(streams):
        """Accumulators of the (weights, scales, block offsets or None, row group) streams over
        all blocks, in lockstep."""
        acc = T.decl_buffer((len(streams) * ROWS,), "float32", scope="global")   # a stack slot: see q4_matmul
        for h in range(len(streams)):
            T.buffer_store(acc, T.broadcast(T.float32(0), ROWS), [T.ramp(h * ROWS, 1, ROWS)])
        with T.serial(0, nb) as b:
            for w, _, _, g in streams:
                prefetch_ahead(w, g, b)
            for h, (w, ws, wc, g) in enumerate(streams):
                value = acc[T.ramp(h * ROWS, 1, ROWS)] + T.Cast("float32x16", _block_dot(T, w, aq, off, g, b, 0, dot)) * (
                    _scales(T, ws, wc, g, b) * T.broadcast(ad[0, b], ROWS))
                if wc is not None:
                    value = value + _offsets_term(T, ws, wc, ad, off, g, b, 0)
                T.buffer_store(acc, value, [T.ramp(h * ROWS, 1, ROWS)])
        return acc

    def store(y, n, g, value):
        """Rows 16g .. of y from value(lane index or ramp, lanes); a ragged group row by row."""
        rows = min(ROWS, n - g * ROWS) if isinstance(g, int) else ROWS
        if rows == ROWS:
            T.buffer_store(y, value(T.ramp(0, 1, ROWS), ROWS), [0, T.ramp(g * ROWS, 1, ROWS)])
        else:
            for r in range(rows):
                T.buffer_store(y, value(r, 1), [0, g * ROWS + r])

    def hidden_halves(weights, gs):
        """silu(gate) * up of row groups gs (2t, 2t + 1): in lockstep, or one after the other."""
        def silu_mul_of(acc, h, count):
            return T.bind(vector_math.silu(T, acc[T.ramp(h * ROWS, 1, ROWS)], ROWS)
                          * acc[T.ramp((count + h) * ROWS, 1, ROWS)])

        if prefetch == "hardware":
            return [silu_mul_of(accumulate([(w, ws, wc, g) for w, ws, wc, _ in weights]), 0, 1) for g in gs]
        acc = accumulate([(w, ws, wc, g) for w, ws, wc, _ in weights for g in gs])
        return [silu_mul_of(acc, h, 2) for h in range(2)]

    def job(task, lo, per, left, weights, y, n):
        """Output rows of `weights` ([(w, ws, wc, bias)]: one output, or gate and up) for tasks
        lo .. lo + per (streams) and lo + per (leftovers)."""
        parts = []
        if per:
            at = task - lo
            gs = [2 * at + h if quantize is not None else h * per + at for h in range(STREAMS // len(weights))]
            parts.append((T.And(task >= lo, task < lo + per), gs))
        if left:
            parts.append((task == lo + per, left))
        for cond, gs in parts:
            with T.If(cond):
                with T.Then():
                    if quantize is not None:   # block `task`: rows of group 2t, then of 2t + 1
                        quantize_block(T, *hidden_halves(weights, gs), *y, 0, task, quantize)
                        continue
                    acc = accumulate([(w, ws, wc, g) for w, ws, wc, _ in weights for g in gs])
                    for h, g in enumerate(gs):
                        def value(i, lanes, h=h, g=g, acc=acc, gs=gs):
                            a = acc[T.ramp(h * ROWS, 1, ROWS) if lanes > 1 else h * ROWS + i]
                            if silu_mul:   # gate's accumulators first, then up's
                                u = acc[T.ramp((len(gs) + h) * ROWS, 1, ROWS) if lanes > 1 else (len(gs) + h) * ROWS + i]
                                return vector_math.silu(T, a, lanes) * u
                            bias = weights[0][3]
                            if bias is None:
                                return a
                            return a + bias[T.ramp(g * ROWS, 1, ROWS) if lanes > 1 else g * ROWS + i]
                        store(y, n, g, value)

    with IRBuilder() as ib:
        with T.prim_func(private=True):
            # opaque: FuseOps leaves it whole; DECODE_GEMV marks it for compiler/sibling_gemvs.py
            marks = {} if silu_mul else {DECODE_GEMV: dot, **({DECODE_PREFETCH: prefetch} if prefetch != "software" else {})}
            T.func_attr({"tir.noalias": True, "op_pattern": 8, SCHEDULED: True, **marks})
            aq = T.arg("aq", T.buffer((1, nb, 32), "int8"))
            ad = T.arg("ad", T.buffer((1, nb), "float32"))
            off = T.arg("off", T.buffer((1, nb), "int32"))
            weights = []
            for i, (n, has_bias, has_offsets) in enumerate(outputs):
                w = T.arg(f"w{i}", T.buffer((groups(n), nb, chunks(dot_bits(dot)), 4 * ROWS), "uint8"))
                ws_shape, ws_dtype, wc_shape, wc_dtype = q4_k_scales.buffers(scale_dtype, groups(n), nb)
                ws = T.arg(f"s{i}", T.buffer(ws_shape, ws_dtype))
                wc = T.arg(f"c{i}", T.buffer(wc_shape, wc_dtype)) if has_offsets else None
                bias = T.arg(f"bias{i}", T.buffer((n,), "float32")) if has_bias else None
                weights.append((w, ws, wc, bias))
            # (n, weights read together, output) per job: each output, or gate and up as one
            n0 = outputs[0][0]
            if quantize is not None:   # the down projection's aq, ad, off
                y = (T.arg("yq", T.buffer((1, n0 // BLOCK, BLOCK), "int8")),
                     T.arg("yd", T.buffer((1, n0 // BLOCK), "float32")), T.arg("yoff", T.buffer((1, n0 // BLOCK), "int32")))
            elif silu_mul:
                y = T.arg("y", T.buffer((1, n0), "float32"))
            jobs = ([(n0, weights, y)] if silu_mul else
                    [(n, [wt], T.arg(f"y{i}", T.buffer((1, n), "float32"))) for i, ((n, _, _), wt) in enumerate(zip(outputs, weights))])
            plan, first = [], 0   # (first task, per, leftover groups) per job
            for n, wts, _ in jobs:   # with `quantize`: per = n / 32 blocks, nothing left over
                per = n // ROWS // (STREAMS // len(wts))
                left = list(range(per * (STREAMS // len(wts)), groups(n)))
                plan.append((first, per, left))
                first += per + (1 if left else 0)
            with task_claims.launch(T, first) as task:
                for (n, wts, y), (lo, per, left) in zip(jobs, plan):
                    job(task, lo, per, left, wts, y, n)
    return ib.get()
