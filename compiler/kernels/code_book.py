"""4-bit indices into a code book (llama.cpp's IQ4_NL and IQ4_XS: qwc/weight_formats.py's
IQ4_BOOK), read by the W4A8 kernels as Q4_0's nibbles are and made int8 values by one byte
shuffle a vector: x86's `vpshufb` (the book plus 128, vpdpbusd's unsigned operand), ARM's `tbl`
(the book as it is, sdot's and smmla's signed one). The indices sit in the row groups as
Q4_0's nibbles do (compiler/repack_iq4.py), so a kernel named here differs from its Q4_0 form
only where it unpacks a chunk and where its sums start.

The table is a constant vector the kernels build from four int32 broadcasts and one shuffle,
which LLVM folds into one constant-pool load hoisted out of the loops: TIR has no vector
literal of distinct bytes, and a buffer argument would change every kernel's signature.
"""

from __future__ import annotations

from tvm import tirx

from qwc.weight_formats import IQ4_BOOK

SUFFIX = "_iq4"   # a W4A8 kernel's name ending so ("vnni_iq4", "sdot_iq4", "smmla_iq4") reads indices


def reads_book(dot: str) -> bool:
    """Whether the W4A8 kernel `dot` reads 4-bit indices into IQ4_BOOK."""
    return dot.endswith(SUFFIX)


def table(T, lanes: int, offset: int):
    """uint8 x `lanes` (a multiple of 16): IQ4_BOOK + `offset` (mod 256) in every 16-byte lane,
    the table operand of a byte shuffle (128: x86's unsigned values; 0: ARM's signed ones)."""
    raw = bytes((v + offset) & 255 for v in IQ4_BOOK)
    words = [int.from_bytes(raw[4 * i:4 * i + 4], "little", signed=True) for i in range(4)]
    n = lanes // 4
    return T.reinterpret(f"uint8x{lanes}", tirx.Shuffle([T.broadcast(T.int32(x), n) for x in words],
                                                        [(i % 4) * n + i for i in range(n)]))
