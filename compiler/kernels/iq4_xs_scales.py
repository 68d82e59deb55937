"""IQ4_XS's scales as ARM's W4A8 kernels read them: the file's, at the file's bytes.

An IQ4_XS super-block of 256 weights holds an fp16 d and a 6-bit ls a sub-block of 32, whose
scale is d (ls - 32). The canonical graph holds the products as float32 (models/gguf_blocks.py),
5 bits a weight with the 4-bit indices where the file spends 4.25; compiler/repack_iq4.py takes
the factors back (gguf_blocks.iq4_xs_factors) and writes, for ARM's kernels:

- ws [G, NB/4, 48] uint8: per row group and run of four blocks (4p .. 4p + 3), the 16 rows' ls
  at six bits as Q4_K's ARM pairs hold sc0, sc1, mn0 and mn1 (q4_k_scales.arm_pair reads them):
  blocks 4p and 4p + 1 in the places of sc0 and sc1, 4p + 2 and 4p + 3 in those of mn0 and mn1;
- wc [G, NB/8, 16] float16: per row group and super-block, the 16 rows' d.

The kernels take llama.cpp's IQ4_XS x Q8_K dot (activations with one scale a super-block:
act_quant's super_blocks): each block's int32 dot of the book's values times ls - 32 (one
`mla` a slice), summed as int32 over the super-block (|sum| < 8 x 32 x 127 x 127 x 32: in
range), then one convert and one FMA with d a, where the float32 form took a convert and two
float operations a block. They tell the form by the scales' dtype (q4_k_scales.SCALE_DTYPE)
on a kernel that reads the book (code_book.reads_book).
"""

from __future__ import annotations

from . import q4_k_scales
from .q4_k_scales import ARM_PAIR, SCALE_DTYPE, SUB_BLOCKS, arm_pair
from .row_groups import ROWS

QUAD = 4          # blocks a 48-byte run of ws holds
OFFSET = 32       # ls - OFFSET is the sub-block's multiplier of d


def kernel_buffers(scale_dtype: str, ng: int, nb: int, isa: str, book: bool) -> tuple[tuple, str, tuple, str]:
    """(ws shape, ws dtype, wc shape, wc dtype) of a W4A8 kernel of `isa` whose scales are
    `scale_dtype`: this form's where the kernel reads the book (`book`) with compact scales,
    else q4_k_scales.buffers'."""
    if scale_dtype == SCALE_DTYPE and book:
        if isa != "arm":
            raise ValueError("IQ4_XS's compact scales are ARM's kernels' form")
        return buffers(ng, nb)
    return q4_k_scales.buffers(scale_dtype, ng, nb, isa)


def buffers(ng: int, nb: int) -> tuple[tuple, str, tuple, str]:
    """(ws shape, ws dtype, wc shape, wc dtype) of an ARM kernel on this form."""
    if nb % SUB_BLOCKS:
        raise ValueError(f"IQ4_XS's scales need whole super-blocks of {SUB_BLOCKS} blocks, got {nb} blocks")
    return (ng, nb // QUAD, ARM_PAIR), "uint8", (ng, nb // SUB_BLOCKS, ROWS), "float16"


def super_block_ls(T, ws, g, s):
    """The 8 blocks' ls of super-block s, row group g, as uint8x16 vectors (rows in order): the
    two runs' arm_pair, three `and` and the fourth value's two `sri` and a shift each."""
    out = []
    for p in range(SUB_BLOCKS // QUAD):
        (a, b), (c, d) = arm_pair(T, ws, g, s * (SUB_BLOCKS // QUAD) + p)
        out += [a, b, c, d]
    return out


def block_ls(T, ws, g, b, lane, lanes: int):
    """uint8 x lanes: ls of rows 16g + lane .. of block b (any expression), in plain arithmetic:
    the prefill kernels make them once a task."""
    def v(i):
        return ws.vload([g, b // QUAD, i * ROWS + lane], f"uint8x{lanes}")

    def bits(x, at: int):
        return (x >> T.broadcast(T.uint8(6), lanes)) << T.broadcast(T.uint8(at), lanes)

    low = T.broadcast(T.uint8(0x3F), lanes)
    place = b % QUAD
    return T.Select(place == 0, v(0) & low, T.Select(place == 1, v(2) & low, T.Select(
        place == 2, v(1) & low, bits(v(0), 0) | bits(v(1), 2) | bits(v(2), 4))))


def block_multipliers(T, ws, g, b, lane, lanes: int):
    """int32 x lanes: ls - 32 of those rows, the integers their block dots are multiplied by."""
    return T.Cast(f"int32x{lanes}", block_ls(T, ws, g, b, lane, lanes)) - T.broadcast(T.int32(OFFSET), lanes)
