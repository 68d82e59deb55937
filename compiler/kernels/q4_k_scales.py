"""Q4_K's scales as the W4A8 kernels read them: as compact as the file holds them.

A Q4_K sub-block of 32 is a Q4_1 block of scale d sc and minimum -dmin mn (models/gguf_blocks.py),
which the kernels take in the Q4_0 form plus a block offset c = m + 8 d sc
(compiler/repack.py: q4_1_block_offsets). Stored expanded, the scales and offsets are two
float32 a row and block: 2 bits a weight beside the codes' 4, where the file spends 0.5. The
compact form keeps the file's factors instead (compiler/repack_q4_k.py writes it):

- ws [G, NB, 32] uint8: per row group and block, the 16 rows' 6-bit sc, then their mn;
- wc [G, NB/8, 32] float16: per row group and super-block of 256, the 16 rows' d, then dmin.

4.625 bits a weight in all. The kernels make d sc and c = 8 d sc - dmin mn in registers once
a block and row group (a tile's tokens share them): d sc and dmin mn are exact products of an
fp16 and a 6-bit integer, and c is rounded once, as the expanded form's float32 c is, so a
block's terms are the same to the bit. The kernels tell the form by the scales' dtype:
SCALE_DTYPE.
"""

from __future__ import annotations

from .row_groups import ROWS

SCALE_DTYPE = "uint8"
SUB_BLOCKS = 8   # blocks of 32 in a super-block


def buffers(scale_dtype: str, ng: int, nb: int) -> tuple[tuple, str, tuple, str]:
    """(ws shape, ws dtype, wc shape, wc dtype) of a W4A8 kernel whose scales are `scale_dtype`:
    this module's form for SCALE_DTYPE, else the expanded [G, NB, 16] scales and float32 offsets."""
    if scale_dtype == SCALE_DTYPE:
        if nb % SUB_BLOCKS:
            raise ValueError(f"Q4_K's compact scales need whole super-blocks of {SUB_BLOCKS} blocks, got {nb} blocks")
        return (ng, nb, 2 * ROWS), SCALE_DTYPE, (ng, nb // SUB_BLOCKS, 2 * ROWS), "float16"
    return (ng, nb, ROWS), scale_dtype, (ng, nb, ROWS), "float32"


def _factor(T, ws, wc, g, b, lane, lanes: int, second: bool):
    """float32 x lanes: rows 16g + lane .. of block b, d sc (or, `second`, dmin mn): exact."""
    at = ROWS if second else 0
    big = T.Cast(f"float32x{lanes}", wc.vload([g, b // SUB_BLOCKS, at + lane], f"float16x{lanes}"))
    small = T.Cast(f"float32x{lanes}", ws.vload([g, b, at + lane], f"uint8x{lanes}"))
    return big * small


def scales(T, ws, wc, g, b, lane, lanes: int):
    """float32 x lanes: the block scales d sc of rows 16g + lane .. + lanes - 1, block b."""
    return _factor(T, ws, wc, g, b, lane, lanes, False)


def offsets(T, ws, wc, g, b, lane, lanes: int):
    """float32 x lanes: those rows' block offsets c = 8 d sc - dmin mn (rounded once)."""
    return (_factor(T, ws, wc, g, b, lane, lanes, False) * T.broadcast(T.float32(8), lanes)
            - _factor(T, ws, wc, g, b, lane, lanes, True))
