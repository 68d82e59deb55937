"""Rotary position tables: the cos / sin caches [positions, head_dim / 2] that
RotaryEmbedding reads, made the same way by the streamed export and by the fuse-rotary pass,
in float32 as transformers computes them (its default rotary, and YaRN: Qwen2.5's long-context
setting, where the tables are all that changes)."""

from __future__ import annotations

import math

import numpy as np


def _pos_freqs(head_dim: int, theta: float) -> np.ndarray:
    """theta^(2i / head_dim) in float32, as transformers computes it: 1 / the rotary frequencies.
    The power is taken in float64 and rounded once: numpy's float32 power on AVX-512 (SVML)
    is off by an ulp for some exponents, which moves a 128k-position angle by 0.008."""
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    return (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies and the factor on cos and sin (transformers'
    `_compute_yarn_parameters`): dimensions that turn fewer than beta_slow times over the
    original context are interpolated (divided by the factor), those that turn more than
    beta_fast times are kept, a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # no zero-width ramp
    pos_freqs = _pos_freqs(head_dim, theta)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)   # the extrapolated (unscaled) share of each dimension
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv.astype(np.float32), float(attention)


def rotary_caches(head_dim: int, theta: float, max_pos: int, scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    if scaling is None:
        inv_freq, attention = (1.0 / _pos_freqs(head_dim, theta)).astype(np.float32), 1.0
    else:
        inv_freq, attention = yarn_inv_freq(head_dim, theta, scaling)
    freqs = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    if attention != 1.0:
        cos, sin = (cos * np.float32(attention)).astype(np.float32), (sin * np.float32(attention)).astype(np.float32)
    return cos, sin


def model_rotary_caches(cfg) -> tuple[np.ndarray, np.ndarray]:
    """The tables of a ModelConfig: every position it serves (context_length), its YaRN if any."""
    return rotary_caches(cfg.head_dim, cfg.rope_theta, cfg.context_length, cfg.rope_scaling)


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves): GGUF
    stores q and k rows, and an adapter's B rows for them, in its rotary layout."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
