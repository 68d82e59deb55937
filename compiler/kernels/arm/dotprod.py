"""W4A8 Q4_0 matmul with NEON `sdot` (Armv8.2 dotprod; Neoverse-N2 has it), one 32-bit lane
per output row: the decode GEMV on every ARM target, and the prefill GEMM where there is no
i8mm (arm-neon).

The weights come in the row-group layout (kernels/row_groups.py): each 64-byte chunk i holds
4 bytes of each of 16 rows, i.e. four 128-bit vectors ("slices") of 4 rows each. Chunk i's
low nibbles meet activation bytes 4i..4i+3 of the de-interleaved block, its high nibbles bytes
16+4i..16+4i+3: 32-bit lane i of the block's first and second 16-byte halves. So the block's
activations are two vector loads, and every sdot takes its 4 bytes by element
(`sdot v.4s, w.16b, a.4b[i]`): no broadcast loads. A block is 8 sdot per slice and token,
whose int32 lanes are then the 4 rows' block dots: one convert and one FMA with the rows'
scales, no horizontal sums.

The nibbles q (0..15) are valid signed bytes, so the dot is taken with q itself and the
quantizer's -8 x sum(a) per block starts the accumulation: no per-vector subtraction.

Decode (one token: decode_gemv, and q4_dot at one token a tile) takes all four slices of a
group per block, so one load of the block's activations, scales and offset serves 16 rows; the
prefill form takes one slice at a time over a tile of tokens, whose accumulators would not fit
the 32 vector registers otherwise.

The same kernels take Q8_0 weights as W8A8 (dot "sdot8"): eight chunks a block of signed codes
already in the activations' order (row_groups.pack_int8), so a block is 8 loads and 8 sdot a
slice with nothing unpacked, started from 0 (the codes are signed: no offset).

A GGUF's Q5_0, Q5_1 and Q5_K take them too (dot "sdot5"): five-bit codes 0..31 as x86's
(row_groups.pack_five_bit: four chunks of nibbles and one of fifth bits, 5 bits a weight where
bytes took 8), each nibble made a code by one `sli` or `sri` with its fifth bit
(_five_bit_codes); their block offsets, or Q5_K's compact factors, as Q4_1's and Q4_K's.

A GGUF's IQ4_NL / IQ4_XS (dot "sdot_iq4": kernels/code_book.py) keep Q4_0's nibbles as 4-bit
indices, each made its int8 value by one `tbl` into the book after Q4_0's `and` or `ushr`; the
values are signed, so their sums start from 0 as Q8_0's do. IQ4_XS with the file's factors
(kernels/iq4_xs_scales.py) takes compact Q4_K's super-block form: its block dots times ls - 32
on int32 sums, one convert and FMA with d a super-block, no minimums (_iq4_xs_super_block).

The prefill GEMM also takes per-token activations (`per_row`, act_quant layout
"arm_rows_flat": design.md, "Two activation formats"), as arm/i8mm.py's does: a block's dots
then take the rows' weight scales only, and the store applies the token's scale and zero point,
y = s (sum over blocks) - s zp R with R each weight row's sum of its values.
"""

from __future__ import annotations

from tvm import tirx

from .. import DECODE_GEMV, SCHEDULED, code_book, dot_bits, iq4_xs_scales, q4_k_scales
from ..kernel_cache import cached_kernel
from ..row_groups import INT8_CHUNKS, ROWS, chunks, groups
from ..w4a8 import block_sum_shift, gemm_kernel, store_rows, token_count

LANES = 4          # int32 lanes of a 128-bit vector: rows per slice
SLICES = ROWS // LANES
SDOT = "llvm.aarch64.neon.sdot.v4i32.v16i8"
SLI = "llvm.aarch64.neon.vsli.v16i8"
TBL = "llvm.aarch64.neon.tbl1.v16i8"
DEFAULT_TOKENS = {"sdot": 4, "sdot8": 4, "sdot5": 4, "sdot_iq4": 4}      # prefill tile width (arm-neon), as x86/vnni.py's
# decode_gemv's: a task holds 16 rows, a Q8_0 block 32 (no quantize); "split": parts of the blocks
DECODE_EPILOGUES = frozenset({"bias", "split"})
UNROLL = 2          # blocks an iteration of the decode GEMV's loop (_decode_gemv: group)
PREFILL_BIAS = False   # a bias is its own kernel after the GEMM


def halved_float(T, v):
    """float32x4 of int32x4 v / 2, exactly (|v| < 2^24): the fixed-point `scvtf v.4s, v.4s, #1`,
    which Neoverse-N2 issues on one vector pipe where the integer form takes both (llvm-mca's
    N2 model; the vector pipes bound these kernels). The kernels double their sums once at
    the store, so the result is the same to the bit."""
    return T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32", v, T.int32(1))


def negated_block_sums(T, ad, off, halved: bool, lanes: int = 1):
    """ad x off x -block_sum_factor(halved), float32 (lanes 4: float32x4 from the vectors):
    the activations' block sums, negated, for the offsets term to subtract. The factor is
    -2^-s, so the fixed-point `scvtf #s` converts and scales off in one instruction (exact:
    |off| < 2^24), where `scvtf` and a multiply took two; times ad this is -(ad x off x factor)
    to the bit, since a power of two commutes with the rounding. The decode GEMV takes the
    vector form on the broadcast offset its sdot chains start from: one instruction less a
    block (a small share of a Q4_K row group's; docs/history/weight-formats.md)."""
    shift = block_sum_shift(halved)
    if lanes == 1:   # LLVM folds the convert and the power of two into `scvtf s, w, #s`
        return ad * (T.Cast("float32", off) * T.float32(2.0 ** -shift))
    return ad * T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32", off, T.int32(shift))


def _lane(T, v, i):
    """int8x16: 32-bit lane i of v in every lane, the by-element operand of an indexed sdot."""
    return T.reinterpret("int8x16", tirx.Shuffle([T.reinterpret("int32x4", v)], [i] * 4))


def _slice_dot(T, w, aq, off, g, b, q, t, bits: int = 4, book: bool = False):
    """int32x4: rows 16g+4q .. +3, block b, token t, as one chain of 8 sdot (one expression:
    named temporaries would become per-thread allocations inside the parallel loop). Q4_0
    (and five-bit codes, `bits` 5, whose block offsets carry the rest) starts from the
    quantizer's offsets; Q8_0's signed codes, the book's values (`book`: 4-bit indices,
    kernels/code_book.py), and with `off` None the raw codes 0..15 or 0..31 (compact Q4_K and
    Q5_K: their minimums are a term of their own), from 0."""
    if bits == 8:
        acc = T.broadcast(T.int32(0), LANES)
        for i in range(INT8_CHUNKS):
            v = T.reinterpret("int8x16", w.vload([g, b, i, 16 * q], "uint8x16"))
            acc = T.call_llvm_pure_intrin("int32x4", SDOT, acc, v, _lane(T, aq.vload([t, b, 16 * (i // 4)], "int8x16"), i % 4))
        return acc
    acc = T.broadcast(T.int32(0) if off is None or book else off[t, b], LANES)
    for i in range(4):
        v = w.vload([g, b, i, 16 * q], "uint8x16")
        if bits == 5:
            lo, hi = _five_bit_codes(T, v, w.vload([g, b, 4, 16 * q], "uint8x16"), i)
        elif book:
            values = T.reinterpret("int8x16", code_book.table(T, 16, 0))
            lo, hi = (T.call_llvm_pure_intrin("int8x16", TBL, values, T.reinterpret("int8x16", x))
                      for x in (v & T.broadcast(T.uint8(15), 16), v >> T.broadcast(T.uint8(4), 16)))
        else:
            lo = T.reinterpret("int8x16", v & T.broadcast(T.uint8(15), 16))
            hi = T.reinterpret("int8x16", v >> T.broadcast(T.uint8(4), 16))
        acc = T.call_llvm_pure_intrin("int32x4", SDOT, acc, lo, _lane(T, aq.vload([t, b, 0], "int8x16"), i))
        acc = T.call_llvm_pure_intrin("int32x4", SDOT, acc, hi, _lane(T, aq.vload([t, b, 16], "int8x16"), i))
    return acc


def _five_bit_codes(T, v, fifth, i: int):
    """(low, high) int8x16: the five-bit codes of chunks i and i + 4 (row_groups.pack_five_bit)
    from stored chunk i's nibbles v and the fifth bits' chunk, whose bits i and i + 4 hold
    theirs. z = (fifth >> i) & 0x11 has the low code's bit at 0 and the high code's at 4 with
    zeros above each, so one `sli` (z << 4 over v's low nibble) and one `sri` (v >> 4 under
    z's top four bits) make the codes: a nibble's one instruction each, as Q4_0's `and` and
    `ushr`, plus the mask and shift that make z."""
    shifted = fifth if i == 0 else fifth >> T.broadcast(T.uint8(i), 16)
    z = shifted & T.broadcast(T.uint8(0x11), 16)
    low = T.call_llvm_pure_intrin("uint8x16", SLI, v, z, T.int32(4))
    high = T.call_llvm_pure_intrin("uint8x16", q4_k_scales.SRI, z, v, T.int32(4))
    return T.reinterpret("int8x16", low), T.reinterpret("int8x16", high)


def _negated_offsets_term(T, ws, wc, ad, off, g, b, q, t):
    """float32x4, halved (halved_float) and negated (subtracted: one `fmls`, as the `fmla` it
    replaces): Q4_1's block offsets of rows 16g+4q .. +3 times the activations' block sum of
    token t (scale x sum of the codes, from the quantizer's int32 offset): the minimum's term,
    one FMA a block and slice. Q4_K's compact scales make the offsets from their factors
    (kernels/q4_k_scales.py)."""
    c = (q4_k_scales.offsets(T, ws, wc, g, b, LANES * q, LANES) if ws.dtype == q4_k_scales.SCALE_DTYPE
         else wc.vload([g, b, LANES * q], "float32x4"))
    return c * negated_block_sums(T, T.broadcast(ad[t, b], LANES), T.broadcast(off[t, b], LANES), halved=True,
                                  lanes=LANES)


def _widened_lanes(T, v, q):
    """int32x4 of bytes 4q .. 4q + 3 of v (uint8x16), zero-extended: one `tbl` whose indices
    are int32 lanes -256 + 4q + r (byte 4q + r, then three indices past the table: zeros), where
    a 4-byte load and two widenings took three instructions."""
    idx = T.reinterpret("int8x16", T.ramp(T.int32(-256 + LANES * q), 1, LANES))
    return T.reinterpret("int32x4", T.call_llvm_pure_intrin("int8x16", TBL,
                                                              T.reinterpret("int8x16", v), idx))


def _scales(T, ws, wc, g, b, q):
    """float32x4: the scales of rows 16g+4q .. +3, block b."""
    if ws.dtype == q4_k_scales.SCALE_DTYPE:
        return q4_k_scales.scales(T, ws, wc, g, b, LANES * q, LANES)
    if ws.dtype == "float16":
        return T.Cast("float32x4", ws.vload([g, b, LANES * q], "float16x4"))
    return ws.vload([g, b, LANES * q], "float32x4")


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q4_dot(n: int, nb: int, decode: bool, scale_dtype: str = "float16", tokens: int | None = None,
           m: int | None = None, bits: int = 4, offsets: bool = False, per_row: bool = False, book: bool = False):
    """y [M, N] from the de-interleaved int8 activations (aq, their scales ad, the -8 x sum
    offsets as int32: act_quant layout "arm") and the row-group weights (`bits` 4: Q4_0, 8:
    Q8_0; `book`: 4-bit indices into the book; `offsets`: with Q4_1's block offsets); M any,
    or `m` (tuning measures at fixed M).
    `per_row` (prefill): activations with a scale and zero point a row (layout
    "arm_rows_flat", ad [M, 2] = (s, s zp)), the weight rows' sums rs [N] the last input."""
    from tvm.script import tirx as T

    if per_row and (decode or offsets):
        raise ValueError("the per-row form is the prefill GEMM's, without block offsets")
    ng = groups(n)
    tm = 1 if decode else (tokens or DEFAULT_TOKENS["sdot"])
    rows_in = token_count(m)

    @T.macro
    def store_per_row(y, acc, t, g, q, k, ad, rs):
        """Row-slice q of group g for token t from acc[4k ..] (halved): 2 s acc - s zp R."""
        row = g * ROWS + LANES * q
        if n % ROWS == 0 or row + LANES <= n:
            y[t, T.ramp(row, 1, LANES)] = acc[T.ramp(k * LANES, 1, LANES)] * T.broadcast(
                ad[t, 0] * T.float32(2), LANES) - T.broadcast(ad[t, 1], LANES) * rs[T.ramp(row, 1, LANES)]
        else:
            for r in range(LANES):
                if row + r < n:
                    y[t, row + r] = acc[k * LANES + r] * (ad[t, 0] * T.float32(2)) - ad[t, 1] * rs[row + r]

    @T.macro
    def store(y, acc, t, g, q, k):
        """Row-slice q of group g for token t from acc[4k .. 4k+3] (doubled: halved_float)."""
        store_rows(y, t, g * ROWS + LANES * q, LANES, n, acc, k * LANES, 2)

    @T.macro
    def group(w, aq, off, ws, ad, y, wc, g, t):
        """All 16 rows of group g for one token: one activation load per block serves 4 slices."""
        acc = T.decl_buffer((SLICES * LANES,), "float32", scope="global")  # a stack slot: see kernels/x86/vnni.py
        for q in T.unroll(SLICES):
            acc[T.ramp(q * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for b in range(nb):
            for q in T.unroll(SLICES):
                acc[T.ramp(q * LANES, 1, LANES)] = acc[T.ramp(q * LANES, 1, LANES)] + halved_float(
                    T, _slice_dot(T, w, aq, off, g, b, q, t, bits, book)) * (
                    _scales(T, ws, wc, g, b, q) * T.broadcast(ad[t, b], LANES))
                if wc is not None:   # decided when the kernel is built
                    acc[T.ramp(q * LANES, 1, LANES)] = acc[T.ramp(q * LANES, 1, LANES)] - _negated_offsets_term(
                        T, ws, wc, ad, off, g, b, q, t)
        for q in T.unroll(SLICES):
            store(y, acc, t, g, q, q)

    @T.macro
    def tile(w, aq, off, ws, ad, y, wc, g, q, first, count, rs):
        """Rows 16g+4q .. +3 of tokens first .. first+count-1 (the unpacked weights serve them
        all); rs: the weight rows' sums (per_row), else None."""
        acc = T.decl_buffer((count * LANES,), "float32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for b in range(nb):
            for t in T.unroll(count):
                if per_row:   # decided when the kernel is built
                    acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + halved_float(
                        T, _slice_dot(T, w, aq, off, g, b, q, first + t, bits, book)) * _scales(T, ws, wc, g, b, q)
                else:
                    acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + halved_float(
                        T, _slice_dot(T, w, aq, off, g, b, q, first + t, bits, book)) * (
                        _scales(T, ws, wc, g, b, q) * T.broadcast(ad[first + t, b], LANES))
                if wc is not None:
                    acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] - _negated_offsets_term(
                        T, ws, wc, ad, off, g, b, q, first + t)
        for t in T.unroll(count):
            if rs is None:   # decided when the kernel is built
                store(y, acc, first + t, g, q, t)
            else:
                store_per_row(y, acc, first + t, g, q, t, ad, rs)

    @T.macro
    def tile_k(w, aq, off, made, ad, y, wc, g, q, first, count):
        """Compact Q4_K's (and Q5_K's) tile, rows 16g+4q .. +3 of tokens first .. first+count-1,
        as the decode GEMV's super-block (_q4_k_super_block): each block's dot of the raw codes
        times its sc and the activations' block offset times its mn, summed as int32 (made: the
        task's sc and mn of its rows, each block), then one convert and one FMA each with d a
        and dmin a a super-block, a the activations' scale (act_quant's super_blocks)."""
        acc = T.decl_buffer((count * LANES,), "float32", scope="global")
        ia = T.decl_buffer((2 * count * LANES,), "int32", scope="global")
        for t in T.unroll(count):
            acc[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
        for s in range(nb // q4_k_scales.SUB_BLOCKS):
            for t in T.unroll(2 * count):
                ia[T.ramp(t * LANES, 1, LANES)] = T.broadcast(T.int32(0), LANES)
            for j in range(q4_k_scales.SUB_BLOCKS):
                for t in T.unroll(count):
                    ia[T.ramp(t * LANES, 1, LANES)] = ia[T.ramp(t * LANES, 1, LANES)] + _slice_dot(
                        T, w, aq, None, g, s * 8 + j, q, first + t, bits, book) * made[
                        T.ramp((s * 8 + j) * LANES, 1, LANES)]
                    if not book:   # IQ4_XS has no minimums (decided when the kernel is built)
                        ia[T.ramp((count + t) * LANES, 1, LANES)] = ia[T.ramp((count + t) * LANES, 1, LANES)] + made[
                            T.ramp((nb + s * 8 + j) * LANES, 1, LANES)] * T.broadcast(off[first + t, s * 8 + j], LANES)
            for t in T.unroll(count):
                if book:   # IQ4_XS: (sum (ls - 32) dot) d a
                    acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + halved_float(
                        T, ia[T.ramp(t * LANES, 1, LANES)]) * (T.Cast("float32x4", wc.vload(
                            [g, s, LANES * q], "float16x4")) * T.broadcast(ad[first + t, s * 8], LANES))
                else:
                    acc[T.ramp(t * LANES, 1, LANES)] = acc[T.ramp(t * LANES, 1, LANES)] + halved_float(
                        T, ia[T.ramp(t * LANES, 1, LANES)]) * (T.Cast("float32x4", wc.vload(
                            [g, s, LANES * q], "float16x4")) * T.broadcast(ad[first + t, s * 8], LANES)) + T.call_llvm_pure_intrin(
                        "float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32", ia[T.ramp((count + t) * LANES, 1, LANES)],
                        T.int32(block_sum_shift(True))) * (T.Cast("float32x4", wc.vload(
                            [g, s, ROWS + LANES * q], "float16x4")) * T.broadcast(ad[first + t, s * 8], LANES))
        for t in T.unroll(count):
            store(y, acc, first + t, g, q, t)

    @T.macro
    def compact_tiles(w, aq, off, ws, ad, y, wc, gq):
        """Task gq's tiles in the compact form (tile_k), its rows' sc and mn out of their six
        bits once, as int32 vectors a block: made once a tile, each tile would unpack them again."""
        made = T.decl_buffer((2 * nb * LANES,), "int32", scope="global")
        for b in range(nb):
            if book:   # IQ4_XS: ls - 32 (decided when the kernel is built)
                made[T.ramp(b * LANES, 1, LANES)] = iq4_xs_scales.block_multipliers(T, ws, gq // SLICES, b,
                                                                                    LANES * (gq % SLICES), LANES)
            else:
                made[T.ramp(b * LANES, 1, LANES)] = q4_k_scales.sub_block_ints(T, ws, gq // SLICES, b,
                                                                               LANES * (gq % SLICES), LANES, False)
                made[T.ramp((nb + b) * LANES, 1, LANES)] = q4_k_scales.sub_block_ints(
                    T, ws, gq // SLICES, b, LANES * (gq % SLICES), LANES, True)
        for it in range(rows_in // tm):
            tile_k(w, aq, off, made, ad, y, wc, gq // SLICES, gq % SLICES, it * tm, tm)
        for i in range(rows_in // tm * tm, rows_in):
            tile_k(w, aq, off, made, ad, y, wc, gq // SLICES, gq % SLICES, i, 1)

    @T.macro
    def slice_tiles(w, aq, off, ws, ad, y, wc, gq, rs):
        """Task gq's tiles: rows 16g + 4q .. + 3 (g, q = gq // SLICES, gq % SLICES) of every token."""
        for it in range(rows_in // tm):
            tile(w, aq, off, ws, ad, y, wc, gq // SLICES, gq % SLICES, it * tm, tm, rs)
        for i in range(rows_in // tm * tm, rows_in):
            tile(w, aq, off, ws, ad, y, wc, gq // SLICES, gq % SLICES, i, 1, rs)

    @T.macro
    def body(w, aq, off, ws, ad, y, wc, rs):
        if tm == 1:
            for g in T.parallel(ng):
                for t in range(rows_in):
                    group(w, aq, off, ws, ad, y, wc, g, t)
        else:
            # a task per slice, as the smmla GEMM's (arm/i8mm.py): few groups still fill T threads
            # (g, q) written out at each use: let-bound, they cost LLVM two registers and spills
            for gq in T.parallel(ng * SLICES):
                if scale_dtype == q4_k_scales.SCALE_DTYPE:   # decided when the kernel is built
                    compact_tiles(w, aq, off, ws, ad, y, wc, gq)
                else:
                    slice_tiles(w, aq, off, ws, ad, y, wc, gq, rs)

    if per_row:
        return gemm_kernel(n, nb, scale_dtype, rows_in, body, chunks=chunks(bits), row_sums=True, isa="arm")

    @T.macro
    def block_body(w, aq, off, ws, ad, y, wc):
        body(w, aq, off, ws, ad, y, wc, None)

    return gemm_kernel(n, nb, scale_dtype, rows_in, block_body, chunks=chunks(bits), offsets=offsets, isa="arm",
                       book=book)


def prefill_gemm(n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
                 batched_decode: bool = False, dot: str = "sdot", offsets: bool = False, per_row: bool = False):
    """The registry's prefill GEMM (kernels/w4a8.py): q4_dot over tiles of tokens."""
    return q4_dot(n, nb, False, scale_dtype, tokens=tokens, m=m, bits=dot_bits(dot), offsets=offsets,
                  per_row=per_row, book=code_book.reads_book(dot))


def decode_gemv(outputs: tuple[tuple[int, bool, bool], ...], nb: int, scale_dtype: str = "float16",
                silu_mul: bool = False, quantize: int | None = None, dot: str = "sdot", split: int = 1):
    """The registry's decode GEMV (kernels/w4a8.py): outputs with biases (and block offsets) only."""
    if silu_mul or quantize is not None:
        raise ValueError("the ARM decode GEMV has no silu_mul / quantize epilogue")
    if split != 1 and (len(outputs) != 1 or not 1 <= split <= nb):
        raise ValueError(f"a decode GEMV splits the blocks of one output, not {len(outputs)} into {split}")
    if scale_dtype == q4_k_scales.SCALE_DTYPE and split > nb // q4_k_scales.SUB_BLOCKS:
        raise ValueError(f"a compact Q4_K decode GEMV splits whole super-blocks: {split} parts of {nb} blocks")
    return _decode_gemv(tuple(outputs), nb, scale_dtype, split, dot)


def block_split(n: int, nb: int, threads: int, scale_dtype: str = "float16") -> int:
    """How many parts a decode GEMV of N rows and nb blocks splits its blocks into, so that
    `threads` threads have a task each: a projection of fewer row groups than threads (a
    0.5B's o and down: 56 groups) leaves the others idle for a whole task. 1 when the groups
    fill the threads (more parts would shorten no thread's work under TVM's static chunks).
    A part is at least 2 blocks: a task's fixed cost (its accumulators' start and store) is
    ~30 instructions against ~100 a block. Compact Q4_K's parts are whole super-blocks."""
    g = groups(n)
    compact = scale_dtype == q4_k_scales.SCALE_DTYPE
    units = nb // q4_k_scales.SUB_BLOCKS if compact else nb   # what a part holds whole
    least = 1 if compact else 2   # a part's fewest units: a super-block, or 2 blocks
    split = 1
    while g * split * 2 <= threads and units // (split * 2) >= least:
        split *= 2
    return split


def _q4_k_super_block(T, w, ws, wc, aq, ad, off, acc, g, s, bits: int):
    """Compact Q4_K (kernels/q4_k_scales.py), super-block s of row group g, on activations
    scaled by super-blocks (act_quant's super_blocks: ad the same at its 8 blocks), as
    llama.cpp's Q4_K x Q8_K dot: per slice, each sub-block's dot of the raw codes (nibbles;
    Q5_K's five bits with `bits` 5) times its 6-bit scale sc, and the activations' block
    offset times the minimum's mn, summed as int32 (the minimums' exact: |sum mn off| < 2^24
    converts exactly); then one convert and one FMA each with d ad and dmin ad. The float
    work comes once a super-block, where the expanded form's came every block. Part of
    _decode_gemv (T: its IR builder's tirx)."""
    ia = T.decl_buffer((2 * SLICES * LANES,), "int32", scope="global")   # a stack slot: see q4_dot
    for q in range(2 * SLICES):
        T.buffer_store(ia, T.broadcast(T.int32(0), LANES), [T.ramp(q * LANES, 1, LANES)])
    # the super-block's sc and mn out of their six bits first, into bytes on the stack that
    # the block loop reads as it read them stored so: decoded in that loop, two blocks an
    # iteration held more vectors than NEON's 32 and spilled
    small = T.decl_buffer((q4_k_scales.SUB_BLOCKS * 2 * ROWS,), "uint8", scope="global")
    for p in range(q4_k_scales.SUB_BLOCKS // 2):
        scs, mns = q4_k_scales.arm_pair(T, ws, g, s * (q4_k_scales.SUB_BLOCKS // 2) + p)
        for half in range(2):
            for i, v in enumerate((scs[half], mns[half])):
                T.buffer_store(small, v, [T.ramp(((2 * p + half) * 2 + i) * ROWS, 1, ROWS)])
    with T.serial(0, q4_k_scales.SUB_BLOCKS) as j:
        b = s * q4_k_scales.SUB_BLOCKS + j
        for q in range(SLICES):
            sc, mn = (_widened_lanes(T, small.vload([(j * 2 + i) * ROWS], "uint8x16"), q) for i in range(2))
            T.buffer_store(ia, ia[T.ramp(q * LANES, 1, LANES)] + _slice_dot(T, w, aq, None, g, b, q, 0, bits) * sc,
                           [T.ramp(q * LANES, 1, LANES)])
            at = T.ramp((SLICES + q) * LANES, 1, LANES)
            T.buffer_store(ia, ia[at] + mn * T.broadcast(off[0, b], LANES), [at])
    a = T.broadcast(ad[0, s * q4_k_scales.SUB_BLOCKS], LANES)
    for q in range(SLICES):
        d = T.Cast("float32x4", wc.vload([g, s, LANES * q], "float16x4"))
        dmin = T.Cast("float32x4", wc.vload([g, s, ROWS + LANES * q], "float16x4"))
        mins = T.call_llvm_pure_intrin("float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32",
                                       ia[T.ramp((SLICES + q) * LANES, 1, LANES)], T.int32(block_sum_shift(True)))
        T.buffer_store(acc, acc[T.ramp(q * LANES, 1, LANES)] + halved_float(T, ia[T.ramp(q * LANES, 1, LANES)]) * (
            d * a) + mins * (dmin * a), [T.ramp(q * LANES, 1, LANES)])


def _iq4_xs_super_block(T, w, ws, wc, aq, ad, acc, g, s):
    """Compact IQ4_XS (kernels/iq4_xs_scales.py), super-block s of row group g, on activations
    scaled by super-blocks, as llama.cpp's IQ4_XS x Q8_K dot: per slice, each block's dot of the
    book's values times its ls - 32, summed as int32, then one convert and one FMA with d ad a
    super-block. The super-block's ls come out of their six bits first, into bytes on the stack
    the block loop reads (as _q4_k_super_block's). Part of _decode_gemv."""
    ia = T.decl_buffer((SLICES * LANES,), "int32", scope="global")   # a stack slot: see q4_dot
    for q in range(SLICES):
        T.buffer_store(ia, T.broadcast(T.int32(0), LANES), [T.ramp(q * LANES, 1, LANES)])
    small = T.decl_buffer((q4_k_scales.SUB_BLOCKS * ROWS,), "uint8", scope="global")
    for j, v in enumerate(iq4_xs_scales.super_block_ls(T, ws, g, s)):
        T.buffer_store(small, v, [T.ramp(j * ROWS, 1, ROWS)])
    with T.serial(0, q4_k_scales.SUB_BLOCKS) as j:
        for q in range(SLICES):
            ls = _widened_lanes(T, small.vload([j * ROWS], "uint8x16"), q) - T.broadcast(
                T.int32(iq4_xs_scales.OFFSET), LANES)
            T.buffer_store(ia, ia[T.ramp(q * LANES, 1, LANES)] + _slice_dot(
                T, w, aq, None, g, s * q4_k_scales.SUB_BLOCKS + j, q, 0, 4, True) * ls, [T.ramp(q * LANES, 1, LANES)])
    a = T.broadcast(ad[0, s * q4_k_scales.SUB_BLOCKS], LANES)
    for q in range(SLICES):
        d = T.Cast("float32x4", wc.vload([g, s, LANES * q], "float16x4"))
        T.buffer_store(acc, acc[T.ramp(q * LANES, 1, LANES)] + halved_float(T, ia[T.ramp(q * LANES, 1, LANES)]) * (d * a),
                       [T.ramp(q * LANES, 1, LANES)])


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def _decode_gemv(outputs: tuple[tuple[int, bool, bool], ...], nb: int, scale_dtype: str, split: int = 1,
                 dot: str = "sdot"):
    """Decode: one token through several weights that read the same activations, in one
    parallel launch: outputs = ((N, with bias, with block offsets), ...). Arguments: aq
    [1, NB, 32], ad [1, NB], off [1, NB] int32 (act_quant layout "arm"), then per output its
    packed weights, scales, Q4_1's block offsets if it has them and bias [N] if it has one,
    then the outputs y [1, N] in order. The bias is added as the rows
    are stored: a projection's bias, or the residual stream (compiler/fuse_residual_gemv.py),
    with no kernel of its own, and q, k and v are one launch (compiler/sibling_gemvs.py).

    A task is one row group of one output (its four slices share each block's activation
    loads, as q4_dot's decode form): the tasks of all outputs together fill the threads, where
    k and v alone (8 groups each at 0.5B) would leave most idle. Built with TVM's IR builder:
    TVMScript signatures cannot vary in length.

    With `split` > 1 (one output): y is [split, N], a task one row group over one part of
    the blocks (block_split), the bias added to part 0; the RMSNorm quantizer that reads y sums
    the parts (act_quant.fused_quantizer's `parts`; compiler/split_residual_gemv.py).
    `dot` "sdot8": Q8_0 weights (8 chunks a block); "sdot5": five-bit codes (5 chunks);
    "sdot_iq4": 4-bit indices into the book."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    def block(w, ws, wc, aq, ad, off, acc, g, b):
        for q in range(SLICES):
            value = acc[T.ramp(q * LANES, 1, LANES)] + halved_float(T, _slice_dot(T, w, aq, off, g, b, q, 0, bits, book)) * (
                _scales(T, ws, wc, g, b, q) * T.broadcast(ad[0, b], LANES))
            if wc is not None:
                value = value - _negated_offsets_term(T, ws, wc, ad, off, g, b, q, 0)
            T.buffer_store(acc, value, [T.ramp(q * LANES, 1, LANES)])

    def group(w, ws, wc, bias, y, n, aq, ad, off, g, part=0, b0=0, b1=nb):
        acc = T.decl_buffer((SLICES * LANES,), "float32", scope="global")   # a stack slot: see q4_dot
        for q in range(SLICES):
            T.buffer_store(acc, T.broadcast(T.float32(0), LANES), [T.ramp(q * LANES, 1, LANES)])
        if compact:   # whole super-blocks (the parts' bounds are)
            with T.serial(b0 // q4_k_scales.SUB_BLOCKS, b1 // q4_k_scales.SUB_BLOCKS) as s:
                if book:
                    _iq4_xs_super_block(T, w, ws, wc, aq, ad, acc, g, s)
                else:
                    _q4_k_super_block(T, w, ws, wc, aq, ad, off, acc, g, s, bits)
        else:
            # UNROLL blocks an iteration: the loop's own counter, compare, branch and pointer
            # increments were a share of a block's instructions worth saving (instructions are
            # what the ARM targets are held to); four ran out of registers. The blocks in order,
            # so the same sums (docs/history/weight-formats.md).
            with T.serial(0, (b1 - b0) // UNROLL) as bu:
                for u in range(UNROLL):
                    block(w, ws, wc, aq, ad, off, acc, g, b0 + bu * UNROLL + u)
            for b in range(b0 + (b1 - b0) // UNROLL * UNROLL, b1):
                block(w, ws, wc, aq, ad, off, acc, g, b)
        for q in range(SLICES):   # doubled: halved_float
            row = g * ROWS + q * LANES

            def value(i, lanes, q=q, row=row):
                a = acc[T.ramp(q * LANES, 1, LANES) if lanes > 1 else q * LANES + i] * (
                    T.broadcast(T.float32(2), lanes) if lanes > 1 else T.float32(2))
                return a if bias is None else a + bias[T.ramp(row, 1, lanes) if lanes > 1 else row + i]
            if n % ROWS == 0:
                T.buffer_store(y, value(0, LANES), [part, T.ramp(row, 1, LANES)])
            else:   # the ragged last group: the rows below N, one at a time
                with T.If(row + LANES <= n):
                    with T.Then():
                        T.buffer_store(y, value(0, LANES), [part, T.ramp(row, 1, LANES)])
                    with T.Else():
                        for i in range(LANES):
                            with T.If(row + i < n):
                                with T.Then():
                                    T.buffer_store(y, value(i, 1), [part, row + i])

    bits, book = dot_bits(dot), code_book.reads_book(dot)
    # compact Q4_K's scales (super_block), which every output of one launch shares (its format)
    compact = scale_dtype == q4_k_scales.SCALE_DTYPE
    if compact and bits not in (4, 5):
        raise ValueError(f"compact K-quant scales on the ARM decode GEMV are Q4_K's or Q5_K's, not {bits}-bit codes'")
    # a part's blocks: [p nb / split, (p + 1) nb / split), in whole super-blocks for compact Q4_K
    unit = q4_k_scales.SUB_BLOCKS if compact else 1

    def bound(p):
        return p * (nb // unit) // split * unit

    with IRBuilder() as ib:
        with T.prim_func(private=True):
            # opaque: FuseOps leaves it whole; DECODE_GEMV marks it for the decode fusions
            T.func_attr({"tir.noalias": True, "op_pattern": 8, SCHEDULED: True, DECODE_GEMV: dot})
            aq = T.arg("aq", T.buffer((1, nb, 32), "int8"))
            ad = T.arg("ad", T.buffer((1, nb), "float32"))
            off = T.arg("off", T.buffer((1, nb), "int32"))
            weights = []
            for i, (n, has_bias, has_offsets) in enumerate(outputs):
                w = T.arg(f"w{i}", T.buffer((groups(n), nb, chunks(bits), 4 * ROWS), "uint8"))
                ws_shape, ws_dtype, wc_shape, wc_dtype = iq4_xs_scales.kernel_buffers(scale_dtype, groups(n), nb, "arm", book)
                ws = T.arg(f"s{i}", T.buffer(ws_shape, ws_dtype))
                wc = T.arg(f"c{i}", T.buffer(wc_shape, wc_dtype)) if has_offsets else None
                bias = T.arg(f"bias{i}", T.buffer((n,), "float32")) if has_bias else None
                weights.append((w, ws, wc, bias, n))
            ys = [T.arg(f"y{i}", T.buffer((split, n), "float32")) for i, (n, _, _) in enumerate(outputs)]
            if split > 1:
                (w, ws, wc, bias, n), y = weights[0], ys[0]
                with T.parallel(0, groups(n) * split) as task:
                    # part p: blocks [bound(p), bound(p + 1)); the bias once, in part 0
                    for p in range(split):
                        with T.If(task % split == p):
                            with T.Then():
                                group(w, ws, wc, bias if p == 0 else None, y, n, aq, ad, off, task // split,
                                      p, bound(p), bound(p + 1))
            else:
                total = sum(groups(o[0]) for o in outputs)
                with T.parallel(0, total) as task:
                    first = 0
                    for (w, ws, wc, bias, n), y in zip(weights, ys):
                        with T.If(T.And(task >= first, task < first + groups(n))):
                            with T.Then():
                                group(w, ws, wc, bias, y, n, aq, ad, off, task - first)
                        first += groups(n)
    return ib.get()
