"""Parameters stored smaller than the kernels read them, and made whole at load.

Some kernels read a weight in a form larger than the file's: ARM's sdot / smmla kernels take
a Q4_K linear's sub-block factors expanded to float32 (scale d sc and offset c a block) where
it cannot take the compact form (compiler/repack_q4_k.py: a tied embedding's gather reads them
too; artifacts compiled before ARM read Q4_K compact), and ARM's Q6_K kernel took its codes as
bytes in artifacts compiled before it read six bits (2026-12-02): `six_bit` loads those.
params.bin keeps such a parameter in a form close to the GGUF's, and the runtime rebuilds the
kernels' form as it loads it (runtime/engine.py), to the bit. The compiler writes a parameter
in its at-rest form only where that round trip is exact (compiler/pack_at_rest.py), so the
library's inputs are the same arrays either way.

Forms (the manifest's `at_rest` of a parameter; its `nbytes` are the stored bytes):
- `six_bit`: bytes whose two's-complement values are in -32..31 (Q6_K's q - 32 as ARM's
  kernel read it before 2026-12-02, int8 or uint8), four in three bytes: u = q + 32 and
  x = u0 | u1 << 6 | u2 << 12 | u3 << 18, little-endian.
- `q4_k_scales`: float32 [G, B, 16] (row groups of 16: kernels/row_groups.py), each row's
  eight consecutive blocks a super-block with s = d sc: sc uint8 [G, B, 16] (0..63), then d
  float16 [G, B/8, 16]. sc = 255 (FREE) is s = 1: a block whose codes are all 0, to which the
  export gives scale 1 (its weights are its minimum whatever the scale).
- `q4_k_offsets`: float32 [G, B, 16], c = m + 8 s rounded once to float32 (m = -dmin mn, s:
  the parameter `scales` names, as loaded): mn uint8 [G, B, 16], then dmin float16 [G, B/8, 16].
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

FORMS = ("six_bit", "q4_k_scales", "q4_k_offsets")
FREE = 255   # q4_k_scales: s = 1
SUPER = 8    # blocks of 32 a Q4_K super-block
ROWS = 16    # rows a row group (kernels/row_groups.py)
CHUNK = 3 << 22   # stored bytes unpacked at a time by one thread: its temporaries stay ~20 MB
THREADS = min(8, len(os.sched_getaffinity(0)))   # a replica pinned to a few cores uses those


def stored_nbytes(form: str, dtype: str, shape: tuple[int, ...]) -> int | None:
    """The stored size of a parameter of this dtype and shape in `form`, or None where the
    form does not hold such a parameter."""
    size = int(np.prod(shape, dtype=np.int64))
    if form == "six_bit":
        return size // 4 * 3 if dtype in ("int8", "uint8") and size % 4 == 0 else None
    if form in ("q4_k_scales", "q4_k_offsets"):
        if dtype != "float32" or len(shape) != 3 or shape[2] != ROWS or shape[1] % SUPER:
            return None
        return size + size // SUPER * 2
    return None


def unpack_six_bit(stored: np.ndarray, out: np.ndarray) -> None:
    """`six_bit` bytes -> `out`, int8 or uint8 (any shape, 4 n values from 3 n bytes), in
    chunks on a few threads (numpy's byte operations release the GIL)."""
    flat = out.reshape(-1).view(np.uint8)

    def chunk(start: int) -> None:
        b = stored[start:start + CHUNK].reshape(-1, 3)
        b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
        part = flat[start // 3 * 4:(start + b.size) // 3 * 4].reshape(-1, 4)
        # u - 32 as a byte: two's complement of q
        part[:, 0] = (b0 & 63) - np.uint8(32)
        part[:, 1] = ((b0 >> 6) | ((b1 & 15) << 2)) - np.uint8(32)
        part[:, 2] = ((b1 >> 4) | ((b2 & 3) << 4)) - np.uint8(32)
        part[:, 3] = (b2 >> 2) - np.uint8(32)

    starts = range(0, stored.size, CHUNK)
    with ThreadPoolExecutor(min(THREADS, len(starts)) or 1) as pool:
        list(pool.map(chunk, starts))


def _factors(stored: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A q4_k form's bytes -> the 6-bit integers [G, B, 16] and the super-blocks' float16
    factors [G, B/8, 16]."""
    g, b, r = shape
    n = g * b * r
    small = stored[:n].reshape(g, b, r)
    big = stored[n:n + n // SUPER * 2].view(np.float16).reshape(g, b // SUPER, r)
    return small, big


def unpack_q4_k_scales(stored: np.ndarray, out: np.ndarray) -> None:
    """`q4_k_scales` bytes -> s = d sc, float32 `out` [G, B, 16] (exact: an fp16 times 0..63)."""
    sc, d = _factors(stored, out.shape)
    g, b, r = out.shape
    np.multiply(d.astype(np.float32)[:, :, None, :], sc.reshape(g, b // SUPER, SUPER, r),
                out=out.reshape(g, b // SUPER, SUPER, r), dtype=np.float32)
    out[sc == FREE] = 1


def unpack_q4_k_offsets(stored: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """`q4_k_offsets` bytes and the loaded scales s -> c = m + 8 s, float32 `out` [G, B, 16],
    the sum exact in float64 and rounded once, as compiler/repack.py's q4_1_block_offsets
    makes it from the file's m."""
    mn, dmin = _factors(stored, out.shape)
    g, b, r = out.shape
    m = -(dmin.astype(np.float64)[:, :, None, :] * mn.reshape(g, b // SUPER, SUPER, r))
    out.reshape(g, b // SUPER, SUPER, r)[:] = (m + 8 * scales.reshape(g, b // SUPER, SUPER, r).astype(np.float64))


def unpack(form: str, stored: np.ndarray, out: np.ndarray, scales: np.ndarray | None = None) -> None:
    """Rebuild the parameter `out` from its stored bytes (uint8) in `form`."""
    if form == "six_bit":
        unpack_six_bit(stored, out)
    elif form == "q4_k_scales":
        unpack_q4_k_scales(stored, out)
    elif form == "q4_k_offsets":
        unpack_q4_k_offsets(stored, scales, out)
    else:
        raise ValueError(f"unknown at-rest form {form!r}")
