"""Q4_K's scales as the W4A8 kernels read them: as compact as the file holds them.

A Q4_K sub-block of 32 is a Q4_1 block of scale d sc and minimum -dmin mn (models/gguf_blocks.py),
which the kernels take in the Q4_0 form plus a block offset c = m + 8 d sc
(compiler/repack.py: q4_1_block_offsets). Stored expanded, the scales and offsets are two
float32 a row and block: 2 bits a weight beside the codes' 4, where the file spends 0.5. The
compact form keeps the file's factors instead (compiler/repack_q4_k.py writes it):

- ws [G, NB, 32] uint8: per row group and block, the 16 rows' 6-bit sc, then their mn (x86);
  on ARM ws [G, NB/2, 48] uint8 holds them at six bits, as the file does: per row group and
  pair of blocks (2p, 2p + 1), three 16-byte vectors A = sc0 + 64 (mn1 & 3), B = mn0 + 64
  ((mn1 >> 2) & 3), C = sc1 + 64 (mn1 >> 4) (ARM_PAIR; compiler/repack_q4_k.py writes it);
- wc [G, NB/8, 32] float16: per row group and super-block of 256, the 16 rows' d, then dmin.

4.625 bits a weight in all on x86, 4.5 on ARM (the file's): a decode step at 64-128 threads
takes the time of the bytes it reads. ARM's three values a pair cost one `and` each, the
fourth two `sri` and a shift (arm_pair), for 16 rows x 64 weights. The kernels make d sc and
c = 8 d sc - dmin mn in registers once a block and row group (a tile's tokens share them):
d sc and dmin mn are exact products of an fp16 and a 6-bit integer, and c is rounded once, as
the expanded form's float32 c is, so a block's terms are the same to the bit. The kernels
tell the form by the scales' dtype (SCALE_DTYPE), and ARM's pairs by their shape
(is_arm_pairs).
"""

from __future__ import annotations

from .row_groups import ROWS

SCALE_DTYPE = "uint8"
SUB_BLOCKS = 8   # blocks of 32 in a super-block
ARM_PAIR = 3 * ROWS   # ARM's bytes of a row group's sc and mn for a pair of blocks
SRI = "llvm.aarch64.neon.vsri.v16i8"


def buffers(scale_dtype: str, ng: int, nb: int, isa: str = "x86") -> tuple[tuple, str, tuple, str]:
    """(ws shape, ws dtype, wc shape, wc dtype) of a W4A8 kernel of `isa` ("x86" | "arm")
    whose scales are `scale_dtype`: this module's form for SCALE_DTYPE (ARM's six-bit pairs on
    "arm"), else the expanded [G, NB, 16] scales and float32 offsets."""
    if scale_dtype == SCALE_DTYPE:
        if nb % SUB_BLOCKS:
            raise ValueError(f"Q4_K's compact scales need whole super-blocks of {SUB_BLOCKS} blocks, got {nb} blocks")
        ws = (ng, nb // 2, ARM_PAIR) if isa == "arm" else (ng, nb, 2 * ROWS)
        return ws, SCALE_DTYPE, (ng, nb // SUB_BLOCKS, 2 * ROWS), "float16"
    return (ng, nb, ROWS), scale_dtype, (ng, nb, ROWS), "float32"


def is_arm_pairs(ws) -> bool:
    """Whether the compact scales ws are ARM's six-bit pairs (by their shape: buffers)."""
    return int(ws.shape[-1]) == ARM_PAIR


def arm_pair(T, ws, g, p):
    """ARM's sc and mn of blocks 2p and 2p + 1, row group g, as uint8x16 (rows in order):
    ((sc0, sc1), (mn0, mn1)). mn1 is C's top two bits with B's, then A's, shifted in below
    by `sri` (each keeps the bits above those it inserts), then shifted down."""
    a, b, c = (ws.vload([g, p, i * ROWS], "uint8x16") for i in range(3))
    low = T.broadcast(T.uint8(0x3F), 16)
    mn1 = T.call_llvm_pure_intrin("uint8x16", SRI, c, b, T.int32(2))
    mn1 = T.call_llvm_pure_intrin("uint8x16", SRI, mn1, a, T.int32(4))
    return (a & low, c & low), (b & low, mn1 >> T.broadcast(T.uint8(2), 16))


def _arm_small(T, ws, g, b, lane, lanes: int, second: bool):
    """uint8 x lanes: sc (or, `second`, mn) of rows 16g + lane .. of block b (any expression) in
    ARM's pairs, in plain arithmetic: the prefill kernels make them once a task."""
    def v(i):
        return ws.vload([g, b // 2, i * ROWS + lane], f"uint8x{lanes}")

    def bits(x, at: int):
        return (x >> T.broadcast(T.uint8(6), lanes)) << T.broadcast(T.uint8(at), lanes)

    low = T.broadcast(T.uint8(0x3F), lanes)
    if second:
        return T.Select(b % 2 == 0, v(1) & low, bits(v(0), 0) | bits(v(1), 2) | bits(v(2), 4))
    return T.Select(b % 2 == 0, v(0) & low, v(2) & low)


def sub_block_bytes(T, ws, g, b, lane, lanes: int, second: bool):
    """uint8 x lanes: sc (or, `second`, mn) of rows 16g + lane .. of block b, either form."""
    return (_arm_small(T, ws, g, b, lane, lanes, second) if is_arm_pairs(ws)
            else ws.vload([g, b, (ROWS if second else 0) + lane], f"uint8x{lanes}"))


def sub_block_ints(T, ws, g, b, lane, lanes: int, second: bool):
    """int32 x lanes: sub_block_bytes widened, the integers the ARM prefill GEMMs multiply their
    int32 block sums by (kernels/arm/i8mm.py, kernels/arm/dotprod.py)."""
    return T.Cast(f"int32x{lanes}", sub_block_bytes(T, ws, g, b, lane, lanes, second))


def _factor(T, ws, wc, g, b, lane, lanes: int, second: bool):
    """float32 x lanes: rows 16g + lane .. of block b, d sc (or, `second`, dmin mn): exact."""
    at = ROWS if second else 0
    big = T.Cast(f"float32x{lanes}", wc.vload([g, b // SUB_BLOCKS, at + lane], f"float16x{lanes}"))
    return big * T.Cast(f"float32x{lanes}", sub_block_bytes(T, ws, g, b, lane, lanes, second))


def element_factors(ws, wc, g, b, r):
    """(d sc, dmin mn) float32 of row 16g + r, block b (TE / TIR expressions of scalars, either
    form): what a gather of one row reads, where the kernels' vector forms read 16 rows."""
    from tvm import tirx

    def u8(v):
        return tirx.const(v, "uint8")

    if is_arm_pairs(ws):
        a, bb, c = (ws[g, b // 2, i * ROWS + r] for i in range(3))
        even = b % 2 == 0
        sc = tirx.if_then_else(even, a & u8(0x3F), c & u8(0x3F))
        mn = tirx.if_then_else(even, bb & u8(0x3F), (a >> u8(6)) | ((bb >> u8(6)) << u8(2)) | ((c >> u8(6)) << u8(4)))
    else:
        sc, mn = ws[g, b, r], ws[g, b, ROWS + r]
    d, dmin = (wc[g, b // SUB_BLOCKS, at + r].astype("float32") for at in (0, ROWS))
    return d * sc.astype("float32"), dmin * mn.astype("float32")


def scales(T, ws, wc, g, b, lane, lanes: int):
    """float32 x lanes: the block scales d sc of rows 16g + lane .. + lanes - 1, block b."""
    return _factor(T, ws, wc, g, b, lane, lanes, False)


def offsets(T, ws, wc, g, b, lane, lanes: int):
    """float32 x lanes: those rows' block offsets c = 8 d sc - dmin mn (rounded once)."""
    return (_factor(T, ws, wc, g, b, lane, lanes, False) * T.broadcast(T.float32(8), lanes)
            - _factor(T, ws, wc, g, b, lane, lanes, True))
