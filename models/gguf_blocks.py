"""A GGUF tensor's quantized blocks as the canonical graph holds them, bit for bit.

llama.cpp's Q4_0, Q4_1 and Q8_0 are blocks of 32 weights along a row with float16 scales:

- Q4_0: d, then 16 bytes of codes q (0..15); w = d * (q - 8);
- Q4_1: d, m, then 16 bytes of codes; w = d * q + m;
- Q8_0: d, then 32 signed bytes q; w = d * q.

onnxruntime's MatMulNBits / GatherBlockQuantized hold the same numbers in their own layout:
codes packed low-first along the row (llama.cpp packs element j with element j + 16, so
the nibbles are reordered, not changed), float32 scales (each the fp16 d exactly), 8-bit
codes as uint8 with the default zero point 128 (q + 128), and Q4_1 as float32 zero points,
w = d * (q - zp) with zp = -m / d. `q4_1_mins` takes m back from (d, zp): it is the fp16
nearest -zp * d, which `from_gguf` checks for every block of the file before anything is
written. A Q4_1 block with d = 0 (all its weights m) is written as d = 1, zp = -m when its
codes are all 0, the only form llama.cpp's quantizer writes; any other is refused.

Other GGUF types (K-quants, IQ, Q5) have no kernel here: they are dequantized and quantized
again to the format the user names (`--requant`, Q8_0 by default: the one that loses least).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qwc.errors import QwcError
from qwc.q4 import pack_nibbles, quantize_q4_0, quantize_q8_0

BLOCK = 32
# GGUF type name -> bytes a block
KEPT = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
REQUANT_CHOICES = ("q8_0", "q4_0")


@dataclass
class Blocks:
    """One [N, K] weight as MatMulNBits takes it: codes [N, K/32, 16 or 32] uint8, scales
    [N, K/32] float32, zero points [N, K/32] float32 (Q4_1 only)."""
    fmt: str                       # "Q4_0", "Q4_1", "Q8_0"
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None

    @property
    def bits(self) -> int:
        return 8 if self.fmt == "Q8_0" else 4


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 (exact)."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 code bytes a block (element j low, j + 16 high) -> the 32 codes in order."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint8)


def from_gguf(raw: np.ndarray, fmt: str, shape: tuple[int, int], name: str) -> Blocks:
    """`raw`: the tensor's bytes, [N, K/32 * bytes-a-block] (GGUFReader's view) or flat."""
    n, k = shape
    if k % BLOCK:
        raise QwcError(f"{name}: {fmt} rows of {k} are not whole blocks of {BLOCK}")
    nb = k // BLOCK
    raw = np.asarray(raw, np.uint8).reshape(n, nb, KEPT[fmt])
    d = _halves(raw, 0)
    if fmt == "Q8_0":
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(fmt, codes, d)
    if fmt == "Q4_0":
        return Blocks(fmt, pack_nibbles(_gguf_nibbles(raw[..., 2:])), d)
    m = _halves(raw, 2)
    q = _gguf_nibbles(raw[..., 4:])
    flat = d == 0
    if flat.any():
        if q[flat].any():
            raise QwcError(f"{name}: a Q4_1 block has scale 0 and non-zero codes (not written by llama.cpp)")
        d = np.where(flat, np.float32(1), d)   # every weight m: 1 * (0 - (-m))
    zp = (-m / d).astype(np.float32)
    back = q4_1_mins(d, zp)
    if not np.array_equal(back.view(np.uint32), m.view(np.uint32)):
        bad = int((back.view(np.uint32) != m.view(np.uint32)).sum())
        raise QwcError(f"{name}: {bad} Q4_1 block minimums do not survive as float zero points")
    return Blocks(fmt, pack_nibbles(q), d, zp)


def q4_1_mins(d: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """m of Q4_1 blocks held as (d, zp): the fp16 nearest -zp * d, as float32."""
    return (-(zp.astype(np.float32) * d.astype(np.float32))).astype(np.float16).astype(np.float32)


def requantize(w: np.ndarray, to: str) -> Blocks:
    """A float [N, K] weight (a dequantized K-quant, say) in Q8_0 or Q4_0."""
    if to == "q8_0":
        q8, d = quantize_q8_0(w, BLOCK)
        return Blocks("Q8_0", (q8.astype(np.int16) + 128).astype(np.uint8), d)
    if to == "q4_0":
        q, d = quantize_q4_0(w, BLOCK)
        return Blocks("Q4_0", pack_nibbles(q), d)
    raise QwcError(f"--requant {to!r} is not one of {', '.join(REQUANT_CHOICES)}")


def dequantize(b: Blocks) -> np.ndarray:
    """The float32 [N, K] weight `b` holds (what the kernels must compute with)."""
    if b.bits == 8:
        q = b.codes.astype(np.float32) - 128
    else:
        lo, hi = b.codes & 15, b.codes >> 4
        q = np.stack([lo, hi], axis=-1).reshape(*b.codes.shape[:-1], -1).astype(np.float32)
        if b.fmt == "Q4_0":
            q -= 8
    w = q * b.scales[..., None]
    if b.zero_points is not None:
        w += q4_1_mins(b.scales, b.zero_points)[..., None]
    return w.reshape(w.shape[0], -1)
