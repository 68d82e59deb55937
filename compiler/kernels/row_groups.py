"""The weight layout qwc's W4A8 integer-dot kernels read (x86 VNNI and ARM sdot alike),
written at compile time by compiler/repack.py so nothing is repacked at load.

Rows are taken in groups of 16; per group and block, 4 chunks of 64 bytes hold 4 packed bytes
(8 weights) of each of the 16 rows:

    packed[g, b, i, 4 * r + c] = byte 4 * i + c of row 16 * g + r in block b   (i, c in 0..3)

A Q4_0 block's byte t holds elements 2t (low nibble) and 2t + 1 (high nibble), and the
activations arrive de-interleaved per block (`act_quant.fused_quantizer`: the 16 even
elements, then the 16 odd ones). So in chunk i the low nibbles meet activation bytes
4i..4i+3 and the high nibbles bytes 16+4i..16+4i+3: broadcast one 4-byte group to every
32-bit lane and one dot-product instruction advances 16 rows (a 512-bit vpdpbusd) or 4 rows
(a 128-bit sdot) by 4 weights each, with the results landing one row per lane.

Scales are stored [G, nb, 16] as fp16 when every scale is exactly an fp16 (always for Q4_0
made by qwc: 18 bytes a block as in llama.cpp, not 20), else fp32.

Q8_0 weights (the W8A8 kernels: pack_int8) take the same form with 8 chunks a block: the
block's 32 codes in the activations' de-interleaved order (even elements, then odd), chunk i
holding codes 4i..4i+3 of each of the 16 rows, so chunk i meets activation bytes 4i..4i+3 as a
Q4_0 chunk's nibbles do. ARM's sdot / smmla take them signed (q), x86's vpdpbusd unsigned
(q + 128, as MatMulNBits stores them; the kernel starts from -128 x sum(a)).
"""

from __future__ import annotations

import numpy as np

ROWS = 16
CHUNKS = 4   # 64-byte chunks per group and block


def groups(n: int) -> int:
    return (n + ROWS - 1) // ROWS


def rows_last(x: np.ndarray, dtype) -> np.ndarray:
    """Per-row values x [N, B] -> [G, B, 16] of `dtype`, rows past N zero: a row group's 16 rows
    side by side for each of its B blocks, as the kernels read per-row factors (a view)."""
    n = x.shape[0]
    g = groups(n)
    out = np.zeros((g * ROWS, x.shape[1]), dtype)
    out[:n] = x
    return out.reshape(g, ROWS, -1).transpose(0, 2, 1)


def pack(wp: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits Q4_0 bytes wp [N, nb, 16] and scales s [N, nb] -> [G, nb, 4, 64] uint8 and
    [G, nb, 16] scales. Rows past N are zero (the kernels do not store them)."""
    n, nb, nbytes = wp.shape
    if nbytes != 16 or s.shape != (n, nb):
        raise ValueError(f"expected Q4_0 bytes [N, nb, 16] and scales [N, nb], got {wp.shape} and {s.shape}")
    g = groups(n)
    w = np.zeros((g * ROWS, nb, 16), np.uint8)
    w[:n] = wp
    # [g, r, b, i, c] -> [g, b, i, r, c]
    w = w.reshape(g, ROWS, nb, CHUNKS, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, CHUNKS, ROWS * 4)
    return np.ascontiguousarray(w), _scales(s, n, g, nb)


def _scales(s: np.ndarray, n: int, g: int, nb: int) -> np.ndarray:
    """Scales [N, nb] -> [G, nb, 16], fp16 where every one is exact in fp16."""
    sc = np.zeros((g * ROWS, nb), np.float32)
    sc[:n] = s
    sc = sc.reshape(g, ROWS, nb).transpose(0, 2, 1)
    half = sc.astype(np.float16)
    exact = np.array_equal(half.astype(np.float32), sc)
    return np.ascontiguousarray(half if exact else sc)


def pack_offsets(c: np.ndarray) -> np.ndarray:
    """Q4_1's block offsets c [N, nb] (compiler/repack.py: q4_1_block_offsets) -> [G, nb, 16]
    float32, laid out as the scales: the kernels add c x the block sum as they apply d."""
    n, nb = c.shape
    g = groups(n)
    out = np.zeros((g * ROWS, nb), np.float32)
    out[:n] = c
    return np.ascontiguousarray(out.reshape(g, ROWS, nb).transpose(0, 2, 1))


INT8_CHUNKS = 8   # 64-byte chunks per group and block of 8-bit codes
FIVE_BIT_CHUNKS = 5   # ... and of five-bit codes (pack_five_bit)


def chunks(bits: int) -> int:
    """64-byte chunks a row group holds per block: Q4_0 (pack), Q8_0 (pack_int8) or five-bit
    codes (pack_five_bit)."""
    return {8: INT8_CHUNKS, 5: FIVE_BIT_CHUNKS}.get(bits, CHUNKS)


def pack_int8(u: np.ndarray, s: np.ndarray, signed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits 8-bit codes u = q + 128 [N, nb, 32] (Q8_0 as qwc stores it) and scales
    [N, nb] -> the codes as bytes [G, nb, 8, 64] (`signed`: q in two's complement, ARM; else u,
    x86) and [G, nb, 16] scales. Rows past N are code 0 (q = 0)."""
    n, nb, block = u.shape
    if block != 32 or s.shape != (n, nb):
        raise ValueError(f"expected 8-bit codes [N, nb, 32] and scales [N, nb], got {u.shape} and {s.shape}")
    g = groups(n)
    q = np.full((g * ROWS, nb, 32), 128, np.uint8)
    q[:n] = u
    if signed:
        q ^= np.uint8(0x80)                               # q + 128 -> q's two's complement byte
    q = q.reshape(g * ROWS, nb, 16, 2).transpose(0, 1, 3, 2)   # de-interleaved: evens, then odds
    # [g, r, b, i, c] -> [g, b, i, r, c]
    w = q.reshape(g, ROWS, nb, INT8_CHUNKS, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, INT8_CHUNKS, ROWS * 4)
    return np.ascontiguousarray(w), _scales(s, n, g, nb)


def pack_five_bit(q: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes q [N, nb, 32] in 0..31 (a GGUF's Q5_0 / Q5_1 / Q5_K, compiler/repack_five_bit.py)
    and scales [N, nb] -> [G, nb, 5, 64] uint8 and [G, nb, 16] scales: pack_int8's eight chunks
    of bytes (u) kept as five, chunk i (i < 4) holding chunk i's low four bits low and chunk
    i + 4's high, as a Q4_0 chunk holds its nibbles, and chunk 4 their fifth bits, bit c of byte
    p for chunk c's byte p. Rows past N are code 0."""
    if q.size and (q.min() < 0 or q.max() > 31):
        raise ValueError("five-bit codes must lie in 0..31")
    u, sc = pack_int8(q.astype(np.uint8), s, signed=False)   # (rows past N: 128, whose low five bits are 0)
    out = np.empty((*u.shape[:2], FIVE_BIT_CHUNKS, u.shape[3]), np.uint8)
    out[:, :, :4] = (u[:, :, :4] & 15) | ((u[:, :, 4:] & 15) << 4)
    out[:, :, 4] = np.bitwise_or.reduce(((u >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None], axis=2)
    return out, sc
