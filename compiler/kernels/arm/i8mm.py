"""W4A8 prefill GEMM with the Armv8.6 I8MM `smmla` (arm-yitian), on the same row-group
weights as the sdot kernels (kernels/row_groups.py).

smmla multiplies a 2x8 int8 matrix by an 8x2 one into a 2x2 int32 tile: lane 2i + j gets
sum_k A[i, k] * B[j, k]: one instruction does 32 multiply-adds, twice an sdot's. Here A holds
two weight rows (8 bytes each), B two tokens, so a tile's lanes are [r0 t0, r0 t1, r1 t0,
r1 t1]. TVM ships no smmla intrinsic; the kernel calls LLVM's `llvm.aarch64.neon.smmla`.

Operands, per block:
- weights: the row-group chunk i holds 4 bytes of each of 4 rows per 128-bit vector; zipping
  the 32-bit lanes of chunks i and i+1 (packed: one zip serves both nibbles) gives rows
  (r, r+1) with 8 consecutive bytes each. Low nibbles then meet activation bytes 8i'..8i'+7
  (i' = i / 2) of the de-interleaved block, high nibbles bytes 16 + 8i'.. .
- activations: the quantizer writes them block-major with token pairs interleaved
  (act_quant.pair_index: the two tokens' 8-byte pieces alternate), so every B operand is one
  16-byte load and a tile's are adjacent (`ldp`); it writes each pair's scales and int32
  offsets as [x t0, x t1, x t0, x t1], one load each: the tile's scale factor and start value.
- the -8 x sum(a) offsets start the accumulation as in the sdot kernels; one convert and one
  FMA per tile and block apply [d r0 d t0, d r0 d t1, d r1 d t0, d r1 d t1].

A tile is 4 rows (one slice of a group) by `tokens` tokens (10: 5 pairs, 10 int32 and 10
float accumulators; 12 fill the 32 vector registers and the allocator starts rotating
accumulators with moves, 8 reload the weights more often: llvm-mca's N2 model puts 10 ahead
in cycles per multiply-add, 0.0368 against 0.0383 and 0.0424); the unpacked
weights of a block serve every pair of the tile. A lone leftover pair joins the last whole
tile's five: as one 6-pair tile (converting plainly) where the weights have no block offsets
(Q4_0, Q8_0, per-row activations: fewer instructions than tiles of 4 and 2), as tiles of 4 and
2 where they have (Q4_1: its 6-pair tile spills; docs/history/arm.md). Other leftovers
take tiles of 4, 2 and 1 pairs, an odd last token a pair with itself, stored once. Decode (one
token) stays on sdot: smmla would waste half its work.

A task with two whole tiles or more unpacks its weights once (_made_operands): each block's 8
B operands and its two row pairs' float32 scales go to a task buffer, which every tile of the
task then loads with `ldp` (the odd last token's excepted: it reads the weights as they are).
Unpacked a tile at a time, the zips, masks, shifts and the scales' zips and converts were
repeated by every tile, a sixth of the block loop; the weights stay in their file form in
memory, and the buffer (160 bytes a block) is the task's rows only. The unpacking loop and the
tiles' loops on the buffer take two blocks an iteration (MADE_UNROLL): their counters,
compares, branches and address arithmetic, and the moves that carried values from one block
to the next, were a share of a block's instructions. The running 5-pair tile (below) keeps
one block an iteration: two spilled its sums.

On per-row activations (one scale a token, applied at the store) those tiles sum by parts:
sum_b d_b D_b = sum_b (d_b - d_(b+1)) S_b, with D_b block b's int32 dot and S_b = D_0 + .. +
D_b. Each pair's int32 dot then runs on over the blocks, never restarted, and a block adds it
times the difference of its scale and the next block's (d_(nb) = 0), which _made_operands
writes in place of the scales. Q4_0's codes are made 16 (q - 8) (_rows' `centred`: an `eor`
of the zipped bytes, then the usual shift or mask), so that no offsets start the sums. The
sums are exact int32 (a block adds at most 32 x 128 x 128 = 2^19, so K up to 2^17 fits:
RUNNING_BLOCKS).

The product joins the tile's sums in fixed point, by Armv8.1's `sqrdmlah` (acc + round(S x c /
2^31)): c is the difference as a Q31 fraction of a power of two P above twice the row's
largest |d| (_power_above), written once a task; the tile's store converts its sums and
multiplies them by P (the convert's fixed point taking out Q4_0's 16 with the half,
RUNNING_FRACTION_BITS). A block then costs its smmla, its loads and one instruction a pair,
where a float sum took a convert and an FMA. Each product rounds to P / 2^31 of S's unit,
which holds the output to a few 1e-4 of its range (tests/compiler/test_kernels.py measures
it; int8 activations' own error is near 1e-2), other terms than the blocks' own, so not the
same bits as the other tiles. Ten pairs' int32 sums fill 20 registers, so the lone leftover
pair does not join the last tile (6 pairs would spill): tiles of 4 and 2 take them. Where
every task unpacks (prompts of 16 tokens or more) these tiles are of 4 pairs (RUNNING_PAIRS),
two blocks an iteration: fewer instructions a token than the 5-pair tile's one block, and the
same sums in the same order, so the same bits; shorter prompts keep the 5-pair tiling.

Q8_0 weights (dot "smmla8", row_groups.pack_int8) take the same tiles: piece k of a row pair
is chunks 2k and 2k + 1 zipped, signed codes with nothing to unpack, the accumulation started
from 0 instead of the offsets. Five-bit codes (dot "smmla5": a GGUF's Q5_0 / Q5_1 / Q5_K,
row_groups.pack_five_bit) zip their nibbles as Q4_0's and their fifth bits alike, each made a
code by one insert (_five_bit_rows), with their block offsets as Q4_1's. A GGUF's IQ4_NL /
IQ4_XS (dot "smmla_iq4": kernels/code_book.py) zip their 4-bit indices as Q4_0's nibbles and
make each its signed value by one `tbl`, started from 0.

Compact Q4_K and Q5_K (the file's factors, kernels/q4_k_scales.py, on Q8_K activations: one
scale a super-block of 256) take llama.cpp's Q4_K x Q8_K dot instead of Q4_1's float work a
block (tile_k): a block's pair dots of the raw codes, from 0, times its 6-bit sc (one `mla`)
into int32 sums; the minimums' term, sum over a super-block's 8 blocks of mn x the
activations' block sums, is itself a 2x8 by 8x2 product, so two smmla a row pair give it (the
block sums, up to 32 x 127, split into a high part -64 .. 63 and a low part 0 .. 63, written
as bytes once a GEMM: block_sum_bytes); one convert and one FMA each for d and dmin a
super-block. Each task unpacks its rows' sc and mn once (task_factors). IQ4_XS with the file's
factors (kernels/iq4_xs_scales.py) takes the same tiles on the book's values with ls - 32 for
sc and no minimums' term.
"""

from __future__ import annotations

import numpy as np
from tvm import tirx

from .. import code_book, dot_bits, iq4_xs_scales, q4_k_scales
from ..kernel_cache import cached_kernel
from ..row_groups import ROWS, chunks, groups
from ..w4a8 import ZERO_POINT, gemm_kernel, token_count
from .dotprod import halved_float, negated_block_sums

LANES = 4          # rows per 128-bit slice of a chunk
SLICES = ROWS // LANES
MERGE_INTO = 5     # tile pairs after which a lone leftover pair joins the last tile's (6, or 4 + 2)
SMMLA = "llvm.aarch64.neon.smmla.v4i32.v16i8"
SLI = "llvm.aarch64.neon.vsli.v16i8"
BOOK = "book"   # the codes of 4-bit indices into the book, where the helpers below take `bits`
DEFAULT_TOKENS = {"smmla": 10, "smmla8": 10, "smmla5": 10, "smmla_iq4": 10}   # 5 token pairs a prefill tile: see this module's docstring
DECODE_EPILOGUES = frozenset()     # prefill only: decode runs arm/dotprod.py's GEMV
PREFILL_BIAS = False   # a bias is its own kernel after the GEMM
MADE_OPERANDS = 8   # a block's B operands: 2 row pairs x 4 pieces of 8 bytes a row
MADE_UNROLL = 2     # blocks an iteration of the loop that unpacks them (_made_operands)
MADE_FROM = 2       # whole tiles a task needs before it unpacks its weights once, not once a tile
RUNNING_BLOCKS = 1 << 12   # K up to 2^17 keeps the running int32 sums exact (module docstring); longer K, the offsets
RUNNING_PAIRS = 4   # the running tiles' pairs where every task unpacks (q4_gemm's long_tiles)
RUNNING_FRACTION_BITS = 5   # the running sums' fixed-point convert: halved as the others, and Q4_0's 16 (q - 8) / 16
SQRDMLAH = "llvm.aarch64.neon.sqrdmlah.v4i32"   # acc + round(a b / 2^31): Armv8.1's RDM, in every ARM target
UNIT_FLOOR = 2.0 ** -30   # the least unit a row's running scales take (a row of zero scales has one too)


def _rows(T, w, g, b, q, k, rp, bits: int | str = 4, centred: bool = False):
    """int8x16: rows (r, r + 1) = 16g + 4q + 2rp + (0, 1), 8 weights each, that meet
    activation piece k (0..3) of block b: chunks 2(k % 2), 2(k % 2) + 1 zipped (packed, so
    one zip serves both nibbles), low nibbles for k < 2, high ones for k >= 2 (`bits` BOOK:
    each index then looked up). Q8_0 codes: chunks 2k, 2k + 1 zipped, as they are.
    `centred` (4 bits): 16 (q - 8) instead of q. Flipping each nibble's top bit (one `eor` of
    the zipped bytes serves both) makes q ^ 8, and q ^ 8 in a byte's high half, read as int8,
    is 16 (q - 8): a shift or a mask a piece, as for q, and no subtraction."""
    assert rp in (0, 1)   # a Python int: it picks the zip pattern
    if bits == 8:
        z = tirx.Shuffle([T.reinterpret("int32x4", w.vload([g, b, 2 * k, 16 * q], "uint8x16")),
                          T.reinterpret("int32x4", w.vload([g, b, 2 * k + 1, 16 * q], "uint8x16"))],
                         [0, 4, 1, 5] if rp == 0 else [2, 6, 3, 7])
        return T.reinterpret("int8x16", z)
    i = 2 * (k % 2)
    pattern = [0, 4, 1, 5] if rp == 0 else [2, 6, 3, 7]
    z = tirx.Shuffle([T.reinterpret("int32x4", w.vload([g, b, i, 16 * q], "uint8x16")),
                      T.reinterpret("int32x4", w.vload([g, b, i + 1, 16 * q], "uint8x16"))], pattern)
    v = T.reinterpret("uint8x16", z)
    if bits == 5:
        return _five_bit_rows(T, v, w.vload([g, b, 4, 16 * q], "uint8x16"), i, pattern, k >= 2)
    if centred:
        v = v ^ T.broadcast(T.uint8(0x88), 16)
        return T.reinterpret("int8x16", (v & T.broadcast(T.uint8(0xF0), 16)) if k >= 2 else (
            v << T.broadcast(T.uint8(4), 16)))
    v = (v >> T.broadcast(T.uint8(4), 16)) if k >= 2 else (v & T.broadcast(T.uint8(15), 16))
    if bits == BOOK:
        return T.call_llvm_pure_intrin("int8x16", "llvm.aarch64.neon.tbl1.v16i8",
                                       T.reinterpret("int8x16", code_book.table(T, 16, 0)), T.reinterpret("int8x16", v))
    return T.reinterpret("int8x16", v)


def _five_bit_rows(T, v, fifth, i: int, pattern, high: bool):
    """int8x16: _rows' pair of rows of five-bit codes (row_groups.pack_five_bit): v the zipped
    nibbles of chunks i and i + 1 (their low nibbles chunks i, i + 1 of the codes, their high
    ones chunks i + 4, i + 5), `fifth` the slice's fifth bits. Zipped the same way, each row's
    first 4 bytes take bits i (low) and i + 4 (high) of its fifth-bit bytes and its next 4 bits
    i + 1 and i + 5: one `ushl` by -i and -(i + 1) in those lanes and an `and` with 0x11 leave
    z with the low code's bit at 0 and the high code's at 4, as dotprod._five_bit_codes' z,
    and one `sli` or `sri` makes the codes."""
    zipped = T.reinterpret("uint8x16", tirx.Shuffle([T.reinterpret("int32x4", fifth)] * 2, pattern))
    def lane(shift):   # an int32 lane of four bytes `shift`
        return T.broadcast(T.int32(int(np.array([shift] * 4, np.int8).view(np.int32)[0])), 4)

    shifts = T.reinterpret("int8x16", tirx.Shuffle([lane(-i), lane(-(i + 1))], [0, 4, 1, 5]))
    z = T.call_llvm_pure_intrin("uint8x16", "llvm.aarch64.neon.ushl.v16i8", zipped, shifts) & T.broadcast(T.uint8(0x11), 16)
    if high:
        return T.reinterpret("int8x16", T.call_llvm_pure_intrin("uint8x16", q4_k_scales.SRI, z, v, T.int32(4)))
    return T.reinterpret("int8x16", T.call_llvm_pure_intrin("uint8x16", SLI, v, z, T.int32(4)))


def _pair_dot(T, w, aqf, init, g, b, q, rp, base, bits: int | str = 4, made=None):
    """int32x4 [r0 t0, r0 t1, r1 t0, r1 t1] of block b for the row pair rp of slice q and the
    token pair whose interleaved block-b activations start at flat index `base`, from `init` (the
    pair's offsets); one expression (named temporaries would become per-thread allocations).
    `made`: the task's operands as _made_operands wrote them, read instead of unpacked."""
    acc = init
    for k in range(4):
        rows = (_rows(T, w, g, b, q, k, rp, bits) if made is None
                else made[0].vload([(b * MADE_OPERANDS + 4 * rp + k) * 16], "int8x16"))
        acc = T.call_llvm_pure_intrin("int32x4", SMMLA, acc, rows, aqf.vload([base + 16 * k], "int8x16"))
    return acc


FIXED_POINT_PAIRS = 5   # tiles up to this many pairs convert with halved_float


def _convert(T, pairs: int, v):
    """float32x4 of v: halved (the fixed-point scvtf, one N2 vector pipe) in tiles of up to
    FIXED_POINT_PAIRS pairs, plain in the 6-pair tile, whose registers are full: there the
    fixed-point form made LLVM rotate accumulators with moves (more instructions and more
    llvm-mca cycles than the plain convert)."""
    return halved_float(T, v) if pairs <= FIXED_POINT_PAIRS else T.Cast("float32x4", v)


def _pair_update(T, w, aqf, adf, offf, ws, wc, g, b, q, rp, at, pairs: int, bits: int | str = 4,
                 per_row: bool = False, made=None):
    """float32x4: block b's contribution to row pair rp of slice q for the token pair whose
    block-b entries start at `at` (in token units: activations at 32 at, scales and offsets at
    2 at), in a tile of `pairs` pairs: the pair dot from its offsets (Q8_0, BOOK: from 0), converted,
    times [d r0 d t0, d r0 d t1, d r1 d t0, d r1 d t1]; `per_row` (activations with a scale a
    row): times the weight scales [d r0, d r0, d r1, d r1] only, the row scales applied once
    as the tile stores. `made`: the task's operands and scales (_made_operands)."""
    init = T.broadcast(T.int32(0), 4) if bits in (8, BOOK) else offf.vload([at * 2], "int32x4")
    dot = _pair_dot(T, w, aqf, init, g, b, q, rp, at * 32, bits, made)
    scales = (_row_scales(T, ws, wc, g, b, q, rp) if made is None
              else made[1].vload([_made_scale(b, rp)], "float32x4"))
    if per_row:
        return _convert(T, pairs, dot) * scales
    return _convert(T, pairs, dot) * (scales * adf.vload([at * 2], "float32x4"))


def _pair_sums(T, adf, offf, at, pairs: int):
    """float32x4 [s t0, s t1, s t0, s t1]: the token pair's block sums (scale x sum of codes,
    from the quantizer's offsets; halved where the tile's sums are), negated
    (dotprod.negated_block_sums), which Q4_1's block offsets multiply: [c r0, c r0, c r1, c r1]
    x this is the pair's minimum term, subtracted."""
    return negated_block_sums(T, adf.vload([at * 2], "float32x4"), offf.vload([at * 2], "int32x4"),
                              halved=pairs <= FIXED_POINT_PAIRS, lanes=4)


def _row_scales(T, ws, wc, g, b, q, rp):
    """float32x4 [d r, d r, d r', d r'] of row pair rp."""
    idx = [0, 0, 1, 1] if rp == 0 else [2, 2, 3, 3]
    if ws.dtype == "float16":   # duplicated while fp16: one zip of 4 halves, then one convert
        return T.Cast("float32x4", tirx.Shuffle([ws.vload([g, b, LANES * q], "float16x4")], idx))
    return tirx.Shuffle([ws.vload([g, b, LANES * q], "float32x4")], idx)


def _row_offsets(T, ws, wc, g, b, q, rp):
    """float32x4 [c r, c r, c r', c r'] of row pair rp: Q4_1's block offsets."""
    idx = [0, 0, 1, 1] if rp == 0 else [2, 2, 3, 3]
    return tirx.Shuffle([wc.vload([g, b, LANES * q], "float32x4")], idx)


def _sub_block_vectors(T, ws, g, b, q, rp, book: bool = False):
    """int32x4 [sc r, sc r, sc r', sc r'] of row pair rp of slice q, block b (`book`: IQ4_XS's
    ls - 32): what the compact tile's int32 pair dots are multiplied by; made once a task
    (q4_gemm's task_factors)."""
    idx = [0, 0, 1, 1] if rp == 0 else [2, 2, 3, 3]
    ints = (iq4_xs_scales.block_multipliers(T, ws, g, b, LANES * q, LANES) if book
            else q4_k_scales.sub_block_ints(T, ws, g, b, LANES * q, LANES, False))
    return tirx.Shuffle([ints], idx)


# byte k of a super-block's minimum rows (_minimum_rows): row 4q + k // 8, block k % 8; its
# source, the blocks' 4-byte vectors concatenated: block k % 8's byte k // 8
MINIMUM_ROWS = [j * LANES + r for r in range(LANES) for j in range(8)]


def _minimum_rows(T, ws, g, s, q):
    """int8x32: slice q's mn of super-block s as super_mins' A operands, row pair 0's then 1's:
    each row's 8 blocks in a row (bytes r0 b0..b7, r1 b0..b7, r2 .., r3 ..), one shuffle of the
    8 blocks' 4-byte vectors."""
    rows = [q4_k_scales.sub_block_bytes(T, ws, g, s * q4_k_scales.SUB_BLOCKS + j, LANES * q, LANES, True)
            for j in range(q4_k_scales.SUB_BLOCKS)]
    return T.reinterpret("int8x32", tirx.Shuffle(rows, MINIMUM_ROWS))


def _super_factors(T, wc, g, s, q, rp, second: bool):
    """float32x4 [d r, d r, d r', d r'] (or, `second`, dmin) of row pair rp of slice q,
    super-block s: fp16, duplicated while fp16 and converted once."""
    idx = [0, 0, 1, 1] if rp == 0 else [2, 2, 3, 3]
    return T.Cast("float32x4", tirx.Shuffle([wc.vload([g, s, (ROWS if second else 0) + LANES * q], "float16x4")], idx))


def _single_dot(T, w, aqf, offf, g, b, q, rp, t, rows_in, codes, raw: bool = False):
    """The odd last token t (plain aq layout) against itself: B's halves both hold it (`raw`:
    the codes as they are, from 0: the compact tile's)."""
    acc = T.broadcast(T.int32(0) if raw or codes in (8, BOOK) else offf[(b * rows_in + t) * 2], 4)
    for k in range(4):
        piece = T.reinterpret("int8x16", T.broadcast(
            T.reinterpret("int64", aqf.vload([(b * rows_in + t) * 32 + 8 * k], "int8x8")), 2))
        acc = T.call_llvm_pure_intrin("int32x4", SMMLA, acc, _rows(T, w, g, b, q, k, rp, codes), piece)
    return acc


def prefill_gemm(n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
                 batched_decode: bool = False, dot: str = "smmla", offsets: bool = False, per_row: bool = False):
    """The registry's prefill GEMM (kernels/w4a8.py): q4_gemm."""
    return q4_gemm(n, nb, scale_dtype, tokens=tokens, m=m, bits=dot_bits(dot), offsets=offsets, per_row=per_row,
                   book=code_book.reads_book(dot))


def decode_gemv(outputs, nb: int, scale_dtype: str = "float16", silu_mul: bool = False, quantize: int | None = None,
                dot: str = "smmla"):
    """Refused: decode runs arm/dotprod.py's GEMV (the rules name sdot for decode)."""
    raise ValueError(f"{dot} is a prefill GEMM only: its targets decode with sdot")


def _made_scale(b, rp):
    """The index of block b's row pair rp scales in a task's made scales."""
    return (b * 2 + rp) * 4


def _power_above(T, big):
    """float32x8: for each lane, the least power of two above 2 max(big, UNIT_FLOOR) (its
    exponent field plus one: exact, and above any difference of two of the row's scales)."""
    bits = T.reinterpret("int32x8", T.max(big, T.broadcast(T.float32(UNIT_FLOOR), 8)) * T.broadcast(T.float32(2), 8))
    return T.reinterpret("float32x8", (bits & T.broadcast(T.int32(0x7F800000), 8)) + T.broadcast(T.int32(0x00800000), 8))


def _fixed_scales(T, v, unit):
    """float32x8 holding the int32 Q31 form of v in units of its row's power of two (v x `unit`,
    2^31 / that power: below 2^31 in magnitude), as the running tiles' `sqrdmlah` reads it."""
    return T.reinterpret("float32x8", T.Cast("int32x8", v * unit))


def _made_operands(nb: int, codes: int | str, running: bool = False):
    """The macro that unpacks slice q of group g once for all its task's tiles: block b's smmla B
    operands (_rows: zipped, unpacked, looked up) at ops[b * 8 + 4 rp + k] and its row-pair
    weight scales ([d r, d r, d r', d r'], float32) at scales[2 b + rp]. A tile's block then
    loads its 8 operands in 4 `ldp` and its scales in one, where unpacking them took 21 (zips,
    masks, shifts, the scales' zips and converts) every tile.
    `running` (the running-sum tiles of per-row activations, q4_gemm's tile): Q4_0's codes
    centred (16 (q - 8): the dots then need no offsets) and, for the scales, each block's less
    the next one's (d_b - d_(b+1), the last block's d as it is) as Q31 fractions of the row's
    unit P (_power_above), which scales[8 nb ..] holds, [P r, P r, P r', P r'] a row pair."""
    from tvm.script import tirx as T

    def block_scales(T, ws, wc, g, b, q):
        return tirx.Shuffle([_row_scales(T, ws, wc, g, b, q, rp) for rp in (0, 1)], list(range(8)))

    @T.macro
    def made_block(w, ws, wc, ops, scales, before, g, q, b):
        ops[T.ramp(b * MADE_OPERANDS * 16, 1, MADE_OPERANDS * 16)] = tirx.Shuffle(
            [_rows(T, w, g, b, q, k, rp, codes, centred=running and codes == 4) for rp in (0, 1) for k in range(4)],
            list(range(MADE_OPERANDS * 16)))
        if running:   # decided when the kernel is built
            d = T.bind(block_scales(T, ws, wc, g, b, q))
            scales[T.ramp(_made_scale(T.max(b - 1, 0), 0), 1, 8)] = _fixed_scales(
                T, before[T.ramp(0, 1, 8)] - d, before[T.ramp(8, 1, 8)])
            before[T.ramp(0, 1, 8)] = d
        else:
            scales[T.ramp(_made_scale(b, 0), 1, 8)] = block_scales(T, ws, wc, g, b, q)

    @T.macro
    def made_operands(w, ws, wc, ops, scales, g, q):
        # each block's scales kept for the next (running; a stack slot LLVM holds in a register),
        # which writes d_(b-1) - d_b; block 0 writes a value block 1 replaces; the last's d after
        # (running: then 2^31 / each row's power of two, at 8)
        before = T.decl_buffer((8 * (2 if running else 1),), "float32", scope="global")
        before[T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
        if running:   # decided when the kernel is built: the rows' powers of two, then their units
            for b in range(nb):
                before[T.ramp(0, 1, 8)] = T.max(before[T.ramp(0, 1, 8)], T.abs(block_scales(T, ws, wc, g, b, q)))
            scales[T.ramp(nb * 8, 1, 8)] = _power_above(T, before[T.ramp(0, 1, 8)])
            before[T.ramp(8, 1, 8)] = T.broadcast(T.float32(2.0 ** 31), 8) / scales[T.ramp(nb * 8, 1, 8)]
            before[T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
        # MADE_UNROLL blocks an iteration, as the decode GEMV's loop: its counter, compare,
        # branch and address arithmetic, and the moves that carried the scales, were a share
        # of this short loop's instructions
        for bu in range(nb // MADE_UNROLL):
            for u in T.unroll(MADE_UNROLL):
                made_block(w, ws, wc, ops, scales, before, g, q, bu * MADE_UNROLL + u)
        for b in range(nb // MADE_UNROLL * MADE_UNROLL, nb):
            made_block(w, ws, wc, ops, scales, before, g, q, b)
        if running:   # decided when the kernel is built
            scales[T.ramp(_made_scale(nb - 1, 0), 1, 8)] = _fixed_scales(T, before[T.ramp(0, 1, 8)], before[T.ramp(8, 1, 8)])

    return made_operands


def _running_update(codes: int | str):
    """The macro that adds block b to row pair rp of token pair p by parts (module docstring):
    the pair's int32 dot runs on over the blocks (from 0, on the made codes less their zero) and
    each block adds it times d_b - d_(b+1) (_made_operands' running scales, Q31) into the fixed-point
    sums, which come to the sum of d_b x block b's dot in the row's unit: one `ldp` of scales
    and one `sqrdmlah` a block, and no offsets to start from."""
    from tvm.script import tirx as T

    @T.macro
    def running_update(w, aqf, dots, made, g, b, q, p, rp, base, fixed):
        """dots: the tile's int32 dots, and its fixed-point sums from `fixed`."""
        dots[T.ramp(8 * p + 4 * rp, 1, 4)] = _pair_dot(T, w, aqf, dots[T.ramp(8 * p + 4 * rp, 1, 4)], g, b, q, rp,
                                                      base, codes, made)
        dots[T.ramp(fixed + 8 * p + 4 * rp, 1, 4)] = T.call_llvm_pure_intrin(
            "int32x4", SQRDMLAH, dots[T.ramp(fixed + 8 * p + 4 * rp, 1, 4)], dots[T.ramp(8 * p + 4 * rp, 1, 4)],
            T.reinterpret("int32x4", made[1].vload([_made_scale(b, rp)], "float32x4")))

    return running_update


def _compact_body(n: int, nb: int, rows_in, codes, tile_pairs: int):
    """q4_gemm's body on compact Q4_K / Q5_K (the module's docstring: llama.cpp's Q4_K x Q8_K dot
    in smmla tiles), as the macro compact_body(w, aqf, adf, offf, ws, wc, y)."""
    from tvm.script import tirx as T

    ng = groups(n)
    ragged = n % ROWS != 0
    supers = nb // q4_k_scales.SUB_BLOCKS
    book = codes == BOOK   # IQ4_XS's compact scales (kernels/iq4_xs_scales.py): no minimums

    def pair_scales(adf, s, t0):
        """float32x4 [a t0, a t1, a t0, a t1]: the token pair's activation scales in super-block s
        (the same at its 8 blocks)."""
        return adf.vload([(s * q4_k_scales.SUB_BLOCKS * rows_in + t0) * 2], "float32x4")

    def super_terms(T, ia, a, mins, wc, g, q, s, at, rp):
        """float32x4: super-block s's terms for row pair rp and tokens whose scales are `a`, from
        the int32 sums of sc x dot at `at` and `mins` (sum of mn x the block sums), both halved
        as the stores double: (sum sc dot) d a - (sum mn bsum) dmin a; IQ4_XS's first term only
        (`mins` None: sc is ls - 32)."""
        term = halved_float(T, ia[T.ramp(at, 1, 4)]) * (_super_factors(T, wc, g, s, q, rp, False) * a)
        if mins is None:
            return term
        return term - halved_float(T, mins) * (_super_factors(T, wc, g, s, q, rp, True) * a)

    def minimums(T, mns, sums, s, q_pair, rp):
        """super_mins, or None for IQ4_XS (decided when the kernel is built)."""
        return None if book else super_mins(T, mns, sums, s, q_pair, rp)

    def super_mins(T, mns, sums, s, q_pair, rp):
        """int32x4: sum over super-block s's blocks of mn x the activations' block sums, for row
        pair rp and the token pair q_pair (sums: block_sum_bytes'), as two smmla: the block
        sums' high parts, shifted by 6, then their low parts."""
        rows = mns.vload([(s * 2 + rp) * 16], "int8x16")
        at = (q_pair * supers + s) * 32
        high = T.call_llvm_pure_intrin("int32x4", SMMLA, T.broadcast(T.int32(0), 4), rows,
                                       sums.vload([at], "int8x16"))
        return T.call_llvm_pure_intrin("int32x4", SMMLA, high << T.broadcast(T.int32(6), 4), rows,
                                       sums.vload([at + 16], "int8x16"))

    @T.macro
    def tile_k(w, aqf, adf, made, mns, sums, wc, y, g, q, first, pairs):
        """Compact Q4_K's (and Q5_K's) tile, rows 16g+4q .. +3 of `pairs` token pairs from token
        `first`, as llama.cpp's Q4_K x Q8_K dot: per super-block, each block's pair dots of the
        raw codes times its sc, summed as int32 (made: the task's sc vectors,
        _sub_block_vectors), and the minimums' products by two smmla (super_mins); then one
        convert and one FMA each with d a and dmin a, a the activations' scale, one a
        super-block (act_quant's super_blocks). The float work of the expanded form's every
        block comes once a super-block."""
        acc = T.decl_buffer((pairs * 8,), "float32", scope="global")
        ia = T.decl_buffer((pairs * 8,), "int32", scope="global")
        for p in T.unroll(pairs * 2):
            acc[T.ramp(p * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
        for s in range(supers):
            for p in T.unroll(pairs * 2):
                ia[T.ramp(p * 4, 1, 4)] = T.broadcast(T.int32(0), 4)
            for j in range(q4_k_scales.SUB_BLOCKS):
                for p in T.unroll(pairs):
                    ia[T.ramp(8 * p, 1, 4)] = ia[T.ramp(8 * p, 1, 4)] + _pair_dot(
                        T, w, aqf, T.broadcast(T.int32(0), 4), g, s * 8 + j, q, 0,
                        ((s * 8 + j) * rows_in + first + 2 * p) * 32, codes) * made[T.ramp((s * 8 + j) * 8, 1, 4)]
                    ia[T.ramp(8 * p + 4, 1, 4)] = ia[T.ramp(8 * p + 4, 1, 4)] + _pair_dot(
                        T, w, aqf, T.broadcast(T.int32(0), 4), g, s * 8 + j, q, 1,
                        ((s * 8 + j) * rows_in + first + 2 * p) * 32, codes) * made[T.ramp((s * 8 + j) * 8 + 4, 1, 4)]
            for p in T.unroll(pairs):
                acc[T.ramp(8 * p, 1, 4)] = acc[T.ramp(8 * p, 1, 4)] + super_terms(
                    T, ia, pair_scales(adf, s, first + 2 * p), minimums(T, mns, sums, s, first // 2 + p, 0),
                    wc, g, q, s, 8 * p, 0)
                acc[T.ramp(8 * p + 4, 1, 4)] = acc[T.ramp(8 * p + 4, 1, 4)] + super_terms(
                    T, ia, pair_scales(adf, s, first + 2 * p), minimums(T, mns, sums, s, first // 2 + p, 1),
                    wc, g, q, s, 8 * p + 4, 1)
        for p in T.unroll(pairs):
            for rp in T.unroll(2):
                for j in T.unroll(2):
                    for tt in T.unroll(2):
                        if not ragged or g * ROWS + LANES * q + 2 * rp + j < n:
                            y[first + 2 * p + tt, g * ROWS + LANES * q + 2 * rp + j] = acc[
                                8 * p + 4 * rp + 2 * j + tt] * T.float32(2)

    @T.macro
    def last_tile_k(w, aqf, adf, offf, made, mns, sums, wc, y, g, q, t):
        """The odd last token in the compact form: tile_k's sums on _single_dot's lanes [r0 t,
        r0 t, r1 t, r1 t] (its block sums a pair with itself: block_sum_bytes), stored once."""
        acc = T.decl_buffer((8,), "float32", scope="global")
        ia = T.decl_buffer((8,), "int32", scope="global")
        for p in T.unroll(2):
            acc[T.ramp(p * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
        for s in range(supers):
            for p in T.unroll(2):
                ia[T.ramp(p * 4, 1, 4)] = T.broadcast(T.int32(0), 4)
            for j in range(q4_k_scales.SUB_BLOCKS):
                ia[T.ramp(0, 1, 4)] = ia[T.ramp(0, 1, 4)] + _single_dot(
                    T, w, aqf, offf, g, s * 8 + j, q, 0, t, rows_in, codes, True) * made[T.ramp((s * 8 + j) * 8, 1, 4)]
                ia[T.ramp(4, 1, 4)] = ia[T.ramp(4, 1, 4)] + _single_dot(
                    T, w, aqf, offf, g, s * 8 + j, q, 1, t, rows_in, codes, True) * made[T.ramp((s * 8 + j) * 8 + 4, 1, 4)]
            acc[T.ramp(0, 1, 4)] = acc[T.ramp(0, 1, 4)] + super_terms(
                T, ia, T.broadcast(adf[(s * q4_k_scales.SUB_BLOCKS * rows_in + t) * 2], 4),
                minimums(T, mns, sums, s, t // 2, 0), wc, g, q, s, 0, 0)
            acc[T.ramp(4, 1, 4)] = acc[T.ramp(4, 1, 4)] + super_terms(
                T, ia, T.broadcast(adf[(s * q4_k_scales.SUB_BLOCKS * rows_in + t) * 2], 4),
                minimums(T, mns, sums, s, t // 2, 1), wc, g, q, s, 4, 1)
        for rp in T.unroll(2):
            for j in T.unroll(2):
                if not ragged or g * ROWS + LANES * q + 2 * rp + j < n:
                    y[t, g * ROWS + LANES * q + 2 * rp + j] = acc[4 * rp + 2 * j] * T.float32(2)

    @T.macro
    def block_sum_bytes(offf, sums):
        """The activations' block sums (sum of a block's codes: its offset / ZERO_POINT) as the
        minimums' smmla read them: per token pair and super-block, the high parts (sum >> 6,
        -64 .. 63) of its 8 blocks for t0 then t1, then the low parts (sum & 63); the odd last
        token a pair with itself. Once a GEMM, before its tasks."""
        for tp in T.parallel((rows_in + 1) // 2):
            for s in range(supers):
                for tt in range(2):
                    for j in range(q4_k_scales.SUB_BLOCKS):
                        total = T.bind(offf[((s * 8 + j) * rows_in + 2 * tp) * 2 + T.if_then_else(
                            2 * tp + 1 < rows_in, tt, 0)] // T.int32(ZERO_POINT))
                        sums[(tp * supers + s) * 32 + tt * 8 + j] = T.Cast("int8", total >> 6)
                        sums[(tp * supers + s) * 32 + 16 + tt * 8 + j] = T.Cast("int8", total & 63)

    @T.macro
    def task_factors(ws, made, mns, gq):
        """Task gq's sc as int32 vectors of each row pair and block (made: tile_k's multipliers)
        and its mn as bytes, per super-block and row pair, rows in order (mns: super_mins' A):
        out of their six bits once a task, which each tile would otherwise unpack again."""
        for b in range(nb):
            made[T.ramp(b * 8, 1, 4)] = _sub_block_vectors(T, ws, gq // SLICES, b, gq % SLICES, 0, book)
            made[T.ramp(b * 8 + 4, 1, 4)] = _sub_block_vectors(T, ws, gq // SLICES, b, gq % SLICES, 1, book)
        if not book:   # IQ4_XS has no minimums (decided when the kernel is built)
            for s in range(supers):
                mns[T.ramp(s * 32, 1, 32)] = _minimum_rows(T, ws, gq // SLICES, s, gq % SLICES)

    @T.macro
    def compact_tiles(w, aqf, adf, offf, made, mns, sums, wc, y, gq):
        """Task gq's tiles in the compact form: whole tiles, then tiles of 4, 2 and 1 pairs for
        the pairs left (slice_tiles' order, without its merged tile), then the odd last token."""
        for it in range(rows_in // (2 * tile_pairs)):
            tile_k(w, aqf, adf, made, mns, sums, wc, y, gq // SLICES, gq % SLICES, it * 2 * tile_pairs, tile_pairs)
        rest = T.bind(rows_in // 2 % tile_pairs)
        p4 = T.bind(rows_in // 2 - rest)
        if tile_pairs > 4:
            if rest >= 4:
                tile_k(w, aqf, adf, made, mns, sums, wc, y, gq // SLICES, gq % SLICES, 2 * p4, 4)
        p2 = T.bind(p4 + rest // 4 * 4)
        if tile_pairs > 2:
            if rest % 4 >= 2:
                tile_k(w, aqf, adf, made, mns, sums, wc, y, gq // SLICES, gq % SLICES, 2 * p2, 2)
        if rest % 2 == 1:
            tile_k(w, aqf, adf, made, mns, sums, wc, y, gq // SLICES, gq % SLICES, 2 * (p2 + rest % 4 // 2 * 2), 1)
        if rows_in % 2 == 1:
            last_tile_k(w, aqf, adf, offf, made, mns, sums, wc, y, gq // SLICES, gq % SLICES, rows_in - 1)

    @T.macro
    def compact_body(w, aqf, adf, offf, ws, wc, y):
        """The compact form's GEMM: the block sums' bytes once, then a task per 4-row slice."""
        sums = T.decl_buffer(((rows_in + 1) // 2 * supers * 32,), "int8", scope="global")
        if not book:   # decided when the kernel is built
            block_sum_bytes(offf, sums)
        for gq in T.parallel(ng * SLICES):
            made = T.decl_buffer((nb * 8,), "int32", scope="global")
            mns = T.decl_buffer((supers * 32,), "int8", scope="global")
            task_factors(ws, made, mns, gq)
            compact_tiles(w, aqf, adf, offf, made, mns, sums, wc, y, gq)

    return compact_body


@cached_kernel   # the same kernel every layer and every compile (kernel_cache.py)
def q4_gemm(n: int, nb: int, scale_dtype: str = "float16", tokens: int | None = None, m: int | None = None,
            bits: int = 4, offsets: bool = False, per_row: bool = False, book: bool = False):
    """y [M, N] (M >= 1, any, or `m` for tuning) from the pair-interleaved int8 activations
    (act_quant layout "arm_pairs") and the row-group weights (`bits` 4: Q4_0, 8: Q8_0;
    `book`: 4-bit indices into the book; `offsets`: with Q4_1's block offsets), in tiles of
    `tokens` (even).
    `per_row`: activations with one scale and zero point a row (layout "arm_rows"; design.md,
    "Two activation formats"). A block then costs the dots and one FMA by the weight scales;
    the tile's stores apply y = s (sum over blocks) - s zp R, with R each weight row's sum of
    its values (the kernel's last input, compiler/row_activations.py)."""
    from tvm.script import tirx as T

    if per_row and offsets:
        raise ValueError("the per-row GEMM takes no block offsets (Q4_1 / Q4_K need each block's activation sum)")
    ng = groups(n)
    codes = BOOK if book else bits   # what the helpers unpack
    ragged = n % ROWS != 0
    tile_pairs = max(1, (tokens or DEFAULT_TOKENS["smmla"]) // 2)   # the tile's unpacked weights serve them all
    rows_in = token_count(m)
    running = per_row and nb <= RUNNING_BLOCKS   # the tiles of made operands sum by parts (module docstring)
    running_update = _running_update(codes)
    running_sums = 2 if running else 1   # the running tiles' dots buffer holds their fixed-point sums too
    units = 8 if running else 0          # the made scales' rows' units (P), after the blocks'

    def row_epilogue(T, v, adf, rs, t0, row):
        """float32x4 v x [s t0, s t1, s t0, s t1] - [s zp t0, s zp t1, ...] x [R r, R r, R r', R r']
        for the token pair from t0 (its (s, s zp) adjacent: one load) and rows (row, row + 1):
        a vector multiply and multiply-subtract a row pair, once a tile."""
        st = adf.vload([t0 * 2], "float32x4")
        last = n - 1
        r = tirx.Shuffle([T.broadcast(rs[T.min(row, last) if ragged else row], 2),
                          T.broadcast(rs[T.min(row + 1, last) if ragged else row + 1], 2)], [0, 1, 2, 3])
        return v * tirx.Shuffle([st], [0, 2, 0, 2]) - tirx.Shuffle([st], [1, 3, 1, 3]) * r

    @T.macro
    def tile_block(w, aqf, adf, offf, ws, wc, g, q, first, pairs, made, acc, dots, b):
        """Block b of a tile (tile's arguments; acc: its float sums; running: dots its int32 dots,
        then its fixed-point sums)."""
        for p in T.unroll(pairs):
            # The two row pairs written out: the zip pattern must be a Python constant (a
            # loop variable's `rp == 0` would not be).
            if made is not None and running:   # decided when the kernel is built
                running_update(w, aqf, dots, made, g, b, q, p, 0, (b * rows_in + first + 2 * p) * 32, pairs * 8)
                running_update(w, aqf, dots, made, g, b, q, p, 1, (b * rows_in + first + 2 * p) * 32, pairs * 8)
            elif wc is None:   # decided when the kernel is built
                acc[T.ramp(8 * p, 1, 4)] = acc[T.ramp(8 * p, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 0, b * rows_in + first + 2 * p, pairs, codes, per_row, made)
                acc[T.ramp(8 * p + 4, 1, 4)] = acc[T.ramp(8 * p + 4, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 1, b * rows_in + first + 2 * p, pairs, codes, per_row, made)
            elif pairs > FIXED_POINT_PAIRS:   # Q4_1 in the full-register 6-pair tile: no held value
                acc[T.ramp(8 * p, 1, 4)] = acc[T.ramp(8 * p, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 0, b * rows_in + first + 2 * p, pairs, codes, made=made) - (
                    _row_offsets(T, ws, wc, g, b, q, 0) * _pair_sums(T, adf, offf, b * rows_in + first + 2 * p, pairs))
                acc[T.ramp(8 * p + 4, 1, 4)] = acc[T.ramp(8 * p + 4, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 1, b * rows_in + first + 2 * p, pairs, codes, made=made) - (
                    _row_offsets(T, ws, wc, g, b, q, 1) * _pair_sums(T, adf, offf, b * rows_in + first + 2 * p, pairs))
            else:   # Q4_1: the pair's block sums once for both row pairs
                sums = T.bind(_pair_sums(T, adf, offf, b * rows_in + first + 2 * p, pairs))
                acc[T.ramp(8 * p, 1, 4)] = acc[T.ramp(8 * p, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 0, b * rows_in + first + 2 * p, pairs, codes, made=made) - (
                    _row_offsets(T, ws, wc, g, b, q, 0) * sums)
                acc[T.ramp(8 * p + 4, 1, 4)] = acc[T.ramp(8 * p + 4, 1, 4)] + _pair_update(
                    T, w, aqf, adf, offf, ws, wc, g, b, q, 1, b * rows_in + first + 2 * p, pairs, codes, made=made) - (
                    _row_offsets(T, ws, wc, g, b, q, 1) * sums)

    @T.macro
    def tile(w, aqf, adf, offf, ws, wc, y, g, q, first, pairs, rs, made):
        """Rows 16g+4q .. +3 of `pairs` token pairs from token `first` (even); rs: the weight
        rows' sums (per_row), else None; made: the task's unpacked operands (_made_operands),
        else None."""
        acc = T.decl_buffer((pairs * 8,), "float32", scope="global")  # a stack slot: see kernels/x86/vnni.py
        for p in T.unroll(pairs * 2):
            acc[T.ramp(p * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
        # running: the int32 dots, then their fixed-point sums from pairs * 8 (unused otherwise)
        dots = T.decl_buffer((pairs * 8 * running_sums,), "int32", scope="global")
        if made is not None and running:   # decided when the kernel is built
            for p in T.unroll(pairs * 2 * running_sums):
                dots[T.ramp(p * 4, 1, 4)] = T.broadcast(T.int32(0), 4)
        if made is not None and not (running and pairs >= FIXED_POINT_PAIRS):   # decided when the kernel is built
            # MADE_UNROLL blocks an iteration, as _made_operands'; not the running 5-pair tile,
            # whose 20 sums leave the two blocks' loads too few registers (it spilled)
            for bu in range(nb // MADE_UNROLL):
                for u in T.unroll(MADE_UNROLL):
                    tile_block(w, aqf, adf, offf, ws, wc, g, q, first, pairs, made, acc, dots, bu * MADE_UNROLL + u)
            for b in range(nb // MADE_UNROLL * MADE_UNROLL, nb):
                tile_block(w, aqf, adf, offf, ws, wc, g, q, first, pairs, made, acc, dots, b)
        else:
            for b in range(nb):
                tile_block(w, aqf, adf, offf, ws, wc, g, q, first, pairs, made, acc, dots, b)
        if made is not None and running:   # decided when the kernel is built: the fixed point's unit
            for p in T.unroll(pairs):
                for rp in T.unroll(2):
                    acc[T.ramp(8 * p + 4 * rp, 1, 4)] = T.call_llvm_pure_intrin(
                        "float32x4", "llvm.aarch64.neon.vcvtfxs2fp.v4f32.v4i32",
                        dots[T.ramp(pairs * 8 + 8 * p + 4 * rp, 1, 4)],
                        T.int32(RUNNING_FRACTION_BITS if codes == 4 else 1)) * made[1].vload([nb * 8 + 4 * rp], "float32x4")
        if rs is not None:   # decided when the kernel is built: s (sum over blocks) - s zp R
            for p in T.unroll(pairs):
                for rp in T.unroll(2):
                    acc[T.ramp(8 * p + 4 * rp, 1, 4)] = row_epilogue(
                        T, acc[T.ramp(8 * p + 4 * rp, 1, 4)] * T.broadcast(
                            T.float32(2 if pairs <= FIXED_POINT_PAIRS else 1), 4),
                        adf, rs, first + 2 * p, g * ROWS + LANES * q + 2 * rp)
        for p in T.unroll(pairs):
            for rp in T.unroll(2):
                for j in T.unroll(2):
                    for tt in T.unroll(2):
                        if not ragged or g * ROWS + LANES * q + 2 * rp + j < n:
                            if rs is None:   # decided when the kernel is built
                                y[first + 2 * p + tt, g * ROWS + LANES * q + 2 * rp + j] = acc[
                                    8 * p + 4 * rp + 2 * j + tt] * T.float32(2 if pairs <= FIXED_POINT_PAIRS else 1)
                            else:
                                y[first + 2 * p + tt, g * ROWS + LANES * q + 2 * rp + j] = acc[8 * p + 4 * rp + 2 * j + tt]

    def token_scale(T, adf, b, t):
        """float32x4 of the odd last token's block-b scale (per_row: 1, the row's at the store)."""
        if per_row:
            return T.broadcast(T.float32(1), 4)
        return T.broadcast(adf[(b * rows_in + t) * 2], 4)

    @T.macro
    def last_tile(w, aqf, adf, offf, ws, wc, y, g, q, t, rs):
        """The odd last token: lanes [r0 t, r0 t, r1 t, r1 t], stored once."""
        acc = T.decl_buffer((8,), "float32", scope="global")
        for p in T.unroll(2):
            acc[T.ramp(p * 4, 1, 4)] = T.broadcast(T.float32(0), 4)
        for b in range(nb):
            acc[T.ramp(0, 1, 4)] = acc[T.ramp(0, 1, 4)] + halved_float(T, _single_dot(
                T, w, aqf, offf, g, b, q, 0, t, rows_in, codes)) * (_row_scales(T, ws, wc, g, b, q, 0) * token_scale(T, adf, b, t))
            acc[T.ramp(4, 1, 4)] = acc[T.ramp(4, 1, 4)] + halved_float(T, _single_dot(
                T, w, aqf, offf, g, b, q, 1, t, rows_in, codes)) * (_row_scales(T, ws, wc, g, b, q, 1) * token_scale(T, adf, b, t))
            if wc is not None:   # Q4_1's block offsets times the token's block sum (halved)
                acc[T.ramp(0, 1, 4)] = acc[T.ramp(0, 1, 4)] - _row_offsets(T, ws, wc, g, b, q, 0) * T.broadcast(
                    negated_block_sums(T, adf[(b * rows_in + t) * 2], offf[(b * rows_in + t) * 2], halved=True), 4)
                acc[T.ramp(4, 1, 4)] = acc[T.ramp(4, 1, 4)] - _row_offsets(T, ws, wc, g, b, q, 1) * T.broadcast(
                    negated_block_sums(T, adf[(b * rows_in + t) * 2], offf[(b * rows_in + t) * 2], halved=True), 4)
        for rp in T.unroll(2):
            for j in T.unroll(2):
                if not ragged or g * ROWS + LANES * q + 2 * rp + j < n:
                    if rs is None:   # decided when the kernel is built
                        y[t, g * ROWS + LANES * q + 2 * rp + j] = acc[4 * rp + 2 * j] * T.float32(2)
                    else:
                        y[t, g * ROWS + LANES * q + 2 * rp + j] = acc[4 * rp + 2 * j] * T.float32(2) * adf[
                            t * 2] - adf[t * 2 + 1] * rs[g * ROWS + LANES * q + 2 * rp + j]

    def merge_last(m, pairs: int):
        """Whether a lone leftover pair joins the last whole tile's pairs (a PrimExpr of M)."""
        if pairs != MERGE_INTO:
            return tirx.const(False)
        return tirx.And(m // 2 % pairs == 1, m // 2 > pairs)

    def tiling(pairs: int, made_only: bool = False):
        """The macro that runs every task's tiles of `pairs` pairs, on its weights unpacked once
        where it has MADE_FROM whole tiles or more (`made_only`: where every task has)."""

        @T.macro
        def tiles_of(w, aqf, adf, offf, ws, wc, y, gq, rs, merge, whole, left, made):
            """Task gq's tiles: rows 16g + 4q .. + 3 (g, q = gq // SLICES, gq % SLICES) of every token
            (made: its unpacked operands, or None)."""
            for it in range(whole):
                tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, it * 2 * pairs, pairs, rs, made)
            if not offsets and pairs == MERGE_INTO:   # decided when the kernel is built
                if merge:   # a lone leftover pair rides with the last whole tile
                    if made is not None and running:   # running sums: 6 pairs' would spill, so 4 and 2
                        tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * whole * pairs, 4, rs, made)
                        tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * whole * pairs + 8, 2, rs,
                             made)
                    else:
                        tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * whole * pairs,
                             pairs + 1, rs, made)
            # the pairs left over (fewer than a tile's, or, with block offsets, 6 where a lone
            # pair joined the last tile's): tiles of 4, 2 and 1 pairs
            p4 = T.bind(rows_in // 2 - left)
            if pairs > 4:
                if left >= 4:
                    tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * p4, 4, rs, made)
            p2 = T.bind(p4 + left // 4 * 4)
            if pairs > 2:
                if left % 4 >= 2:
                    tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * p2, 2, rs, made)
            if left % 2 == 1:
                tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, 2 * (p2 + left % 4 // 2 * 2), 1, rs, made)
            if rows_in % 2 == 1:
                last_tile(w, aqf, adf, offf, ws, wc, y, gq // SLICES, gq % SLICES, rows_in - 1, rs)

        @T.macro
        def slice_tiles(w, aqf, adf, offf, ws, wc, y, gq, rs, merge, whole, left):
            """Task gq's tiles, on its weights unpacked once where it has MADE_FROM whole tiles or
            more (fewer: the unpacking's stores and loads would cost more than they save)."""
            if made_only or whole >= MADE_FROM:
                # two buffers: one (scales after each block's operands) added moves to the
                # 4-pair running loop of a kernel of any M (a buffer's own address is one add)
                ops = T.decl_buffer((nb * MADE_OPERANDS * 16,), "int8", scope="global")
                scales = T.decl_buffer((nb * 8 + units,), "float32", scope="global")
                made_operands(w, ws, wc, ops, scales, gq // SLICES, gq % SLICES)
                tiles_of(w, aqf, adf, offf, ws, wc, y, gq, rs, merge, whole, left, (ops, scales))
            else:
                tiles_of(w, aqf, adf, offf, ws, wc, y, gq, rs, merge, whole, left, None)

        @T.macro
        def tasks(w, aqf, adf, offf, ws, wc, y, rs):
            # One leftover pair after whole tiles of 5 is taken with the last of them: fewer
            # instructions than a 5-pair tile and a 1-pair one (whose multiply-adds cost twice).
            # Without block offsets as one 6-pair tile; with them (Q4_1, Q5_1) as tiles of 4 and
            # 2, since their 6-pair tile fills the 32 vector registers (moves and spills in its
            # loop; docs/history/weight-formats.md, docs/history/arm.md). Other leftovers below.
            # T.bind: a name assigned plainly in a macro becomes a one-element buffer, which TVM
            # gives a workspace allocation (a call, per task for those inside the loop)
            merge = T.bind(merge_last(rows_in, pairs))
            whole = T.bind(rows_in // (2 * pairs) - T.Cast("int64", merge))
            left = T.bind(rows_in // 2 % pairs + (pairs if offsets else -1) * T.Cast("int64", merge))
            # One task per 4-row slice, not per 16-row group: a projection of few groups (k and v:
            # 8 on the 0.5B) then still fills 32-128 threads; TVM hands each thread a contiguous
            # run of slices, so below that a thread still takes whole groups. (g, q) are written
            # out at each use: let-bound, they cost LLVM two registers and spills in the tile loop.
            for gq in T.parallel(ng * SLICES):
                slice_tiles(w, aqf, adf, offf, ws, wc, y, gq, rs, merge, whole, left)

        return tasks

    made_operands = _made_operands(nb, codes, running=running)
    tiles = tiling(tile_pairs)
    # running sums on made operands in tiles of RUNNING_PAIRS where every task unpacks (its 2-block
    # loop executes fewer instructions a token than the 5-pair tile's); shorter prompts keep 5
    long_pairs = RUNNING_PAIRS if running and tokens is None else tile_pairs
    long_tiles = tiling(long_pairs, made_only=True)

    compact_body = _compact_body(n, nb, rows_in, codes, tile_pairs) if scale_dtype == q4_k_scales.SCALE_DTYPE else None

    @T.macro
    def body(w, aq, off, ws, ad, y, wc, rs):
        aqf = T.decl_buffer((rows_in * nb * 32,), "int8", data=aq.data)
        adf = T.decl_buffer((rows_in * 2 if per_row else rows_in * nb * 2,), "float32", data=ad.data)
        offf = T.decl_buffer((rows_in * nb * 2,), "int32", data=off.data)
        if scale_dtype == q4_k_scales.SCALE_DTYPE:   # decided when the kernel is built
            compact_body(w, aqf, adf, offf, ws, wc, y)
        elif long_pairs == tile_pairs:   # decided when the kernel is built
            tiles(w, aqf, adf, offf, ws, wc, y, rs)
        elif rows_in >= 2 * MADE_FROM * long_pairs:
            long_tiles(w, aqf, adf, offf, ws, wc, y, rs)
        else:
            tiles(w, aqf, adf, offf, ws, wc, y, rs)

    if per_row:
        return gemm_kernel(n, nb, scale_dtype, rows_in, body, pair_scales=True, chunks=chunks(bits), row_sums=True,
                           isa="arm")

    @T.macro
    def block_body(w, aq, off, ws, ad, y, wc):
        body(w, aq, off, ws, ad, y, wc, None)

    return gemm_kernel(n, nb, scale_dtype, rows_in, block_body, pair_scales=True,
                       chunks=chunks(bits), offsets=offsets, isa="arm", book=book)
