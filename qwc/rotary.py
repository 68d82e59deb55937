"""Rotary position tables: the cos / sin caches [max_positions, head_dim / 2] that
RotaryEmbedding reads, made the same way by the streamed export and by the fuse-rotary pass."""

from __future__ import annotations

import numpy as np


def rotary_caches(head_dim: int, theta: float, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
                ).astype(np.float32)
    freqs = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
