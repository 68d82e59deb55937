"""Block quantization arithmetic shared by every stage: llama.cpp's Q4_0 and Q8_0.

Q4_0 (symmetric, one fp16 scale per block): d = m / -8 where m is the block's element of
largest magnitude, with its sign; q = min(15, trunc(x / d + 8.5)); w = (q - 8) * d. The
arithmetic follows llama.cpp's `quantize_row_q4_0_ref` in float32 step by step (the
reciprocal is taken from the float32 d, the stored d is rounded to fp16), so the values are
bit-identical. Only the nibble order of the packed bytes differs: onnxruntime's MatMulNBits
puts element 2j in the low nibble and 2j+1 in the high one; llama.cpp puts j and j+16.

Q8_0 (used when the embedding / lm_head stay at 8 bits): d = amax / 127, q = round(x / d).

A row whose length is not a multiple of the block is padded with zeros to whole blocks.
models/qat.py mirrors `fake_quantize_q4_0` in torch; the tests hold the two equal.
"""

from __future__ import annotations

import numpy as np


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    pad = -k % block
    if pad:
        w = np.concatenate([w, np.zeros((n, pad), np.float32)], axis=1)
    return w.reshape(n, -1, block)


# Rows are quantized in chunks of about this many elements: the arithmetic's float32
# temporaries are a few times the chunk, not a few times the weight (a 7B's embedding is 545M elements).
CHUNK_ELEMENTS = 1 << 24


def row_chunks(w: np.ndarray):
    rows = max(1, CHUNK_ELEMENTS // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):
        yield slice(r, min(r + rows, w.shape[0]))


def _by_row_chunks(w, block: int, qtype, rows_fn) -> tuple[np.ndarray, np.ndarray]:
    """`rows_fn` (one chunk of rows -> its q and d) over `w` [N, K] a chunk at a time."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    nb = -(-w.shape[1] // block)
    q, d = np.empty((w.shape[0], nb, block), qtype), np.empty((w.shape[0], nb), np.float32)
    for rows in row_chunks(w):
        q[rows], d[rows] = rows_fn(w[rows], block)
    return q, d


def quantize_q4_0(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows of `w` [N, K]. Returns q uint8 [N, nb, block] in 0..15 and the
    fp16-representable scales d float32 [N, nb]."""
    return _by_row_chunks(w, block, np.uint8, _q4_0_rows)


def _q4_0_rows(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    x = _blocks(w, block)
    idx = np.argmax(np.abs(x), axis=2)[..., None]
    m = np.take_along_axis(x, idx, axis=2)[..., 0]
    d = (m / np.float32(-8.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = (x * inv[..., None]).astype(np.float32) + np.float32(8.5)
    q = np.minimum(np.trunc(v), 15).astype(np.uint8)
    return q, d.astype(np.float16).astype(np.float32)


def dequantize_q4_0(q: np.ndarray, d: np.ndarray, k: int | None = None) -> np.ndarray:
    w = ((q.astype(np.float32) - 8.0) * d[..., None]).reshape(q.shape[0], -1)
    return w if k is None else w[:, :k]


def fake_quantize_q4_0(w: np.ndarray, block: int = 32) -> np.ndarray:
    """The float weight a Q4_0 round trip gives (what a quantized kernel computes with)."""
    q, d = quantize_q4_0(w, block)
    return dequantize_q4_0(q, d, np.asarray(w).shape[1])


def quantize_q8_0(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Returns q int8 [N, nb, block] and fp16-representable scales d float32 [N, nb]."""
    return _by_row_chunks(w, block, np.int8, _q8_0_rows)


def _q8_0_rows(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    x = _blocks(w, block)
    amax = np.max(np.abs(x), axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = (x * inv[..., None]).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)  # roundf: half away from 0
    return q, d.astype(np.float16).astype(np.float32)


def _round_away(v: np.ndarray) -> np.ndarray:
    """roundf (halves away from zero), exactly in float32: the fraction |v| - floor(|v|) is exact."""
    a = np.abs(v)
    r = np.floor(a)
    return np.copysign(r + (a - r >= np.float32(0.5)), v).astype(np.float32)


def quantize_rows_asym(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token int8 activations with a zero point (KleidiAI's qai8dx; the ARM "arm_rows"
    quantizer, compiler/kernels/act_quant.py, in the same float32 steps): x [M, K] ->
    (q int8 [M, K], s [M], zp [M]) with x ~ s (q - zp); the row's range widened to hold 0,
    which is then exact (a row of zeros: s 1, zp 0, codes 0)."""
    x = np.asarray(x, np.float32)
    lo = np.minimum(x.min(-1), np.float32(0))
    hi = np.maximum(x.max(-1), np.float32(0))
    span = (hi - lo).astype(np.float32)
    s = np.where(span > 0, span / np.float32(255), np.float32(1)).astype(np.float32)
    zp = np.where(span > 0, _round_away((np.float32(0) - lo / s).astype(np.float32)) - np.float32(128),
                  np.float32(0)).astype(np.float32)
    q = np.clip(_round_away((x / s[:, None]).astype(np.float32)) + zp[:, None], -128, 127)
    return q.astype(np.int8), s, zp


def fake_quantize_rows_asym(x: np.ndarray) -> np.ndarray:
    """x through quantize_rows_asym and back."""
    q, s, zp = quantize_rows_asym(x)
    return ((q.astype(np.float32) - zp[:, None]) * s[:, None]).astype(np.float32)


def fake_quantize_q8_0_activations(x: np.ndarray) -> np.ndarray:
    """x [M, K] (K a multiple of 32) through the W4A8 kernels' Q8_0 blocks (float32 scales) and back."""
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _round_away((b / np.where(d > 0, d, np.float32(1))).astype(np.float32))
    return (q * d).reshape(x.shape).astype(np.float32)


def dequantize_q8_0(q: np.ndarray, d: np.ndarray, k: int | None = None) -> np.ndarray:
    w = (q.astype(np.float32) * d[..., None]).reshape(q.shape[0], -1)
    return w if k is None else w[:, :k]


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 2m] values 0..15 -> [..., m] bytes, element 2j low nibble (onnxruntime order)."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    out[..., 0::2] = b & 0x0F
    out[..., 1::2] = b >> 4
    return out
