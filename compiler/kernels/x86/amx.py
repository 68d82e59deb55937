"""The prefill GEMM's 16-token tiles on Intel AMX (`tdpbssd`), for x86/vnni.py and x86/q6_k.py.

AMX multiplies a tile of int8 activations A [16 tokens, K bytes] by a tile B whose row r holds
4 bytes of K (4r .. 4r + 3) for each of 16 output rows: exactly a chunk of the row-group layout
(kernels/row_groups.py), so a block of 32 is a B tile of 8 such rows. One `tdpbssd` instruction
then makes the 16 x 16 int32 block dots of 16 tokens and 16 rows, which VNNI makes with 128
`vpdpbusd`.

Each block has its own weight and activation scales, so the int32 tile is stored after every
block and scaled as VNNI's sums are (a convert, a product of the scales and an FMA a token,
in the same order: the outputs are VNNI's to the bit): that epilogue, not the tile multiply,
is what a block costs. Two sets of tile registers alternate between even and odd blocks, and
block b's stored tile is scaled only after block b + 2's multiply is issued: the stores go to a
ring of SLOTS tiles, so the loads that scale a tile no longer wait right behind the
`tilestored` that wrote it (one block behind, with two stored tiles, they did:
docs/history/x86-speed.md).

A row group's B tiles are made once and serve all its token tiles (made a tile at a time, a
block's B tile was read by `tileloadd` right after the vector stores that wrote it: slower than
VNNI, where made once it is faster: docs/history/x86-speed.md).

The codes become signed int8 as the B tiles are made: q - 8 for Q4_0's nibbles and the
five-bit codes, q = u - 128 for Q8_0's unsigned bytes u. The signed-by-signed `tdpbssd` then
needs no zero-point start, where VNNI's unsigned operand starts from the quantizer's offset (a
broadcast and an add a token and block: with them, Q8_0's tiles were no faster than VNNI's).

Linux grants AMX's tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
qwc/cpu.py's enable_amx, called before an artifact with these kernels runs.
"""

from __future__ import annotations

from .. import code_book, dot_bits
from ..row_groups import ROWS

TOKENS = 16        # tokens a tile: the rows of an A tile
BLOCK = 32         # bytes of K a block: A's columns; B's rows are BLOCK / 4
_A, _B, _C = 0, 1, 2   # tile registers of the even blocks; the odd blocks' are 3 higher
_SETS = 2
LAG = 2            # blocks between a tile's multiply and its scaling (a multiple of _SETS)
SLOTS = 4          # stored C tiles (a power of two above LAG): cs [SLOTS, TOKENS * ROWS]


def _intrin(T, name, *args):
    return T.evaluate(T.call_llvm_intrin("void", name, *args))


def _configurer(T, tiles: int, width, rows):
    """The macro that loads a tile configuration from a 64-byte buffer cfg: palette 1; bytes 16
    + 2i: tile i's bytes a row (a uint16 below 256), byte 48 + i: its rows, `width(k)` and
    `rows(k)` of the k-th of each set's `tiles` tiles (k a loop variable)."""

    @T.macro
    def configure(cfg):
        for i in T.unroll(64):
            cfg[i] = T.uint8(0)
        cfg[0] = T.uint8(1)
        for i in T.unroll(tiles * _SETS):
            cfg[16 + 2 * i] = width(i % tiles)
            cfg[48 + i] = rows(i % tiles)
        _intrin(T, "llvm.x86.ldtilecfg", T.address_of(cfg[0]))

    return configure


def _pipelined(T, nb: int, multiply, scale):
    """The macro that runs nb blocks of one 16-token tile: `multiply(*m, b, first, s)` block b's
    tile multiply on tile set s, stored into cs[b % SLOTS]; `scale(*c, b, first)` its scaling,
    LAG multiplies later and in block order (the first and last LAG blocks unrolled)."""
    steady = (nb - LAG) // 2 if nb > LAG else 0   # the loop's pairs: multiplies LAG.., scalings 0..
    scaled = 2 * steady

    @T.macro
    def pipelined(m, c, first):
        for p in T.unroll(min(LAG, nb)):
            multiply(*m, p, first, p % _SETS)
        for b2 in range(steady):
            multiply(*m, LAG + 2 * b2, first, 0)
            scale(*c, 2 * b2, first)
            multiply(*m, LAG + 2 * b2 + 1, first, 1)
            scale(*c, 2 * b2 + 1, first)
        if nb > LAG and (nb - LAG) % 2 == 1:   # decided when the kernel is built
            multiply(*m, nb - 1, first, (nb - 1) % _SETS)
        for r in T.unroll(nb - scaled):
            scale(*c, scaled + r, first)

    return pipelined


def macros(T, nb: int, dot: str, codes, scales):
    """(configure, make_b, blocks) for x86/vnni.py's GEMM, given its readers of the weights
    (`codes(w, g, b, i, high)`, uint8x64; `scales(ws, wc, g, b)`, float32x16, so that this
    module imports none of the kernels it serves): `configure(cfg)` loads the tile
    configuration from a 64-byte buffer (once a task: it is a thread's state); `make_b(w, bt,
    g)` makes row group g's B tiles into bt [nb, 512]; `blocks(...)` adds every block's dots of
    16 tokens and one row group to two 8-token float accumulators `lo`, `hi` (halves below
    TVM's 1 KiB stack bound, so that LLVM keeps them in registers), through cs [SLOTS, 256],
    the stored C tiles."""
    bits = dot_bits(dot)
    # what makes a code chunk's bytes signed: q - 8 from Q4_0's nibbles; the book's codes
    # book[q] + 128 (kernels/code_book.py), as Q8_0's q + 128, less 128
    signed = 128 if code_book.reads_book(dot) else 248

    def intrin(name, *args):
        return _intrin(T, name, *args)

    # a set: A TOKENS x BLOCK bytes; B BLOCK / 4 rows x 64; C TOKENS x 64 (16 int32)
    configure = _configurer(T, 3, lambda k: T.if_then_else(k == _A, T.uint8(BLOCK), T.uint8(4 * ROWS)),
                            lambda k: T.if_then_else(k == _B, T.uint8(BLOCK // 4), T.uint8(TOKENS)))

    @T.macro
    def scale_into(acc, ws, ad, wc, sums, cs, g, b, first, half, s):
        """acc (8 tokens) += tokens first + 8 half .. + 7 of C tile s, scaled, plus the block
        offsets wc (float32 here: x86/vnni.py's tiled expands Q4_K's) times the activations'
        block sums, made beforehand (`sums`: tiled), as VNNI's _offsets_term rounds them."""
        for t in T.unroll(8):
            acc[T.ramp(t * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)] + T.Cast(
                "float32x16", cs[s, T.ramp((8 * half + t) * ROWS, 1, ROWS)]) * (
                scales(ws, wc, g, b) * T.broadcast(ad[first + 8 * half + t, b], ROWS))
            if wc is not None:   # decided when the kernel is built
                acc[T.ramp(t * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)] + wc.vload(
                    [g, b, 0], "float32x16") * T.broadcast(sums[first + 8 * half + t, b], ROWS)

    @T.macro
    def make_b(w, bt, g):
        """Row group g's B tiles as signed codes: Q8_0's chunk r as row r, q = u - 128; the
        others' rows 0-3 the low codes of chunks 0-3, rows 4-7 the high ones, as q - 8 (the
        book's values: book[q])."""
        for b in range(nb):
            if bits == 8:   # decided when the kernel is built
                for r in T.unroll(8):
                    bt[b, T.ramp(r * 4 * ROWS, 1, 4 * ROWS)] = codes(w, g, b, r, False) + T.broadcast(
                        T.uint8(128), 4 * ROWS)
            else:
                for r in T.unroll(4):
                    bt[b, T.ramp(r * 4 * ROWS, 1, 4 * ROWS)] = codes(w, g, b, r, False) + T.broadcast(
                        T.uint8(signed), 4 * ROWS)
                    bt[b, T.ramp((4 + r) * 4 * ROWS, 1, 4 * ROWS)] = codes(w, g, b, r, True) + T.broadcast(
                        T.uint8(signed), 4 * ROWS)

    @T.macro
    def multiply(aq, bt, cs, b, first, s):
        """Block b's int32 dots of tokens first .. first + 15 on tile set s, stored into cs[b % SLOTS]."""
        intrin("llvm.x86.tileloadd64", T.uint8(_B + 3 * s), T.address_of(bt[b, 0]), T.int64(4 * ROWS))
        intrin("llvm.x86.tileloadd64", T.uint8(_A + 3 * s), T.address_of(aq[first, b, 0]), T.int64(nb * BLOCK))
        intrin("llvm.x86.tilezero", T.uint8(_C + 3 * s))
        intrin("llvm.x86.tdpbssd", T.uint8(_C + 3 * s), T.uint8(_A + 3 * s), T.uint8(_B + 3 * s))
        intrin("llvm.x86.tilestored64", T.uint8(_C + 3 * s), T.address_of(cs[b % SLOTS, 0]), T.int64(4 * ROWS))

    @T.macro
    def scale(ws, ad, wc, sums, lo, hi, cs, g, b, first):
        """lo, hi += block b's dots in cs[b % SLOTS], scaled."""
        scale_into(lo, ws, ad, wc, sums, cs, g, b, first, 0, b % SLOTS)
        scale_into(hi, ws, ad, wc, sums, cs, g, b, first, 1, b % SLOTS)

    pipelined = _pipelined(T, nb, multiply, scale)

    @T.macro
    def blocks(aq, ws, ad, wc, sums, lo, hi, bt, cs, g, first):
        """Every block of tokens first .. first + 15, in order (`_pipelined`)."""
        pipelined((aq, bt, cs), (ws, ad, wc, sums, lo, hi, cs, g), first)

    return configure, make_b, blocks


# -- Q6_K (x86/q6_k.py) ------------------------------------------------------------------------
# A 32-block holds two sub-blocks of 16 with their own scales: A at the de-interleaved
# positions 0-7 and 16-23 (chunks 0, 1, 4, 5), B at 8-15 and 24-31 (chunks 2, 3, 6, 7). A tile's
# columns are contiguous, so the activations are copied once a GEMM with each block's bytes in
# the order A, then B (`sub_block_order`), and a group's B tiles hold A's chunks, then B's: a
# sub-block is then one multiply of K = 16, into its own C tile.
Q6_K_TILES = 4     # tile registers a set: activations, weights, and a C tile per sub-block
Q6_K_ZERO = 224    # q - 32 as int8, modulo 256: the codes are 0..63


def q6_k_macros(T, nb: int, term, chunk_codes):
    """(configure, sub_block_order, make_b, blocks) for x86/q6_k.py's GEMM, as `macros` above:
    `term(lo, hi, sc, d, ad, g, b, t)` is that kernel's scaling of a block's two sub-block sums
    (the same arithmetic, so the outputs are its VNNI tiles' bits); `chunk_codes(w, g, b, i,
    sub_b)` its uint8x64 codes of sub-block A's or B's i-th chunk (0..3)."""

    def intrin(name, *args):
        return _intrin(T, name, *args)

    # a set: activations TOKENS x 16 bytes; weights 4 rows x 64; two C tiles TOKENS x 64
    configure = _configurer(T, Q6_K_TILES, lambda k: T.if_then_else(k == 0, T.uint8(BLOCK // 2), T.uint8(4 * ROWS)),
                            lambda k: T.if_then_else(k == 1, T.uint8(BLOCK // 8), T.uint8(TOKENS)))

    @T.macro
    def sub_block_order(aq, ar, t):
        """Token t's activation bytes, each block's 0-7 and 16-23 (sub-block A) then 8-15 and
        24-31 (B)."""
        for b in range(nb):
            for h in T.unroll(4):   # bytes 8h .. 8h + 7 go to 8 (h // 2 + 2 (h % 2)) ..
                ar[t, b, T.ramp((h // 2 + 2 * (h % 2)) * 8, 1, 8)] = aq[t, b, T.ramp(h * 8, 1, 8)]

    @T.macro
    def make_b(w, bt, g):
        """Row group g's B tiles: block b's rows 0-3 sub-block A's chunks, 4-7 B's, as q - 32."""
        for b in range(nb):
            for i in T.unroll(4):
                bt[b, T.ramp(i * 4 * ROWS, 1, 4 * ROWS)] = chunk_codes(w, g, b, i, False) + T.broadcast(
                    T.uint8(Q6_K_ZERO), 4 * ROWS)
                bt[b, T.ramp((4 + i) * 4 * ROWS, 1, 4 * ROWS)] = chunk_codes(w, g, b, i, True) + T.broadcast(
                    T.uint8(Q6_K_ZERO), 4 * ROWS)

    @T.macro
    def multiply(ar, bt, cs, b, first, s):
        """Block b's two sub-block sums of tokens first .. first + 15 on tile set s, into cs[b % SLOTS]."""
        for h in T.unroll(2):
            intrin("llvm.x86.tileloadd64", T.uint8(Q6_K_TILES * s), T.address_of(ar[first, b, h * BLOCK // 2]),
                   T.int64(nb * BLOCK))
            intrin("llvm.x86.tileloadd64", T.uint8(Q6_K_TILES * s + 1), T.address_of(bt[b, h * 2 * BLOCK * 4]),
                   T.int64(4 * ROWS))
            intrin("llvm.x86.tilezero", T.uint8(Q6_K_TILES * s + 2 + h))
            intrin("llvm.x86.tdpbssd", T.uint8(Q6_K_TILES * s + 2 + h), T.uint8(Q6_K_TILES * s),
                   T.uint8(Q6_K_TILES * s + 1))
        for h in T.unroll(2):
            intrin("llvm.x86.tilestored64", T.uint8(Q6_K_TILES * s + 2 + h), T.address_of(cs[b % SLOTS, h, 0]),
                   T.int64(4 * ROWS))

    @T.macro
    def scale_half(ad, sc, d, acc, cs, g, b, first, half):
        """acc (8 tokens) += tokens first + 8 half .. + 7 of block b's two stored sub-block sums, scaled."""
        for t in T.unroll(8):
            acc[T.ramp(t * ROWS, 1, ROWS)] = acc[T.ramp(t * ROWS, 1, ROWS)] + term(
                cs[b % SLOTS, 0, T.ramp((8 * half + t) * ROWS, 1, ROWS)],
                cs[b % SLOTS, 1, T.ramp((8 * half + t) * ROWS, 1, ROWS)], sc, d, ad, g, b, first + 8 * half + t)

    @T.macro
    def scale(ad, sc, d, lo, hi, cs, g, b, first):
        """lo, hi += block b's sums in cs[b % SLOTS], scaled."""
        scale_half(ad, sc, d, lo, cs, g, b, first, 0)
        scale_half(ad, sc, d, hi, cs, g, b, first, 1)

    pipelined = _pipelined(T, nb, multiply, scale)

    @T.macro
    def blocks(ar, ad, sc, d, lo, hi, bt, cs, g, first):
        """Every block of tokens first .. first + 15, in order (`_pipelined`)."""
        pipelined((ar, bt, cs), (ad, sc, d, lo, hi, cs, g), first)

    return configure, sub_block_order, make_b, blocks
