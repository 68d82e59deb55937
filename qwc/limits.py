"""Bounds on what a user may ask for, shared by the CLI and the runtime's API."""

from __future__ import annotations

import numbers
import os

MAX_LORA_RANK = 256   # `qwc compile --max-lora-rank`: the largest adapter rank slots take
MAX_BATCH = 256   # `qwc compile --max-batch`: sequences one batched decode step may carry
# `qwc compile --kv-dtype` (llama.cpp's -ctk / -ctv names) -> the KV cache's format, as the
# manifest records it (q8_0: llama.cpp's blocks of 32 int8 and a float16 scale)
KV_TYPES = {"f32": "float32", "f16": "float16", "q8_0": "q8_0"}
# `--draft-max`'s default: tokens a speculative draft proposes at most. With the token before it
# a verify call then has 8 tokens, the most the x86 GEMM takes in decode's streams (x86/vnni.py:
# FEW_TOKENS); a ninth token puts the call on prefill's tiles, which cost a step more
# (docs/results/serving.md has the costs).
DRAFT_MAX = 7


def cache_row(fmt: str, head_dim: int) -> tuple[str, int]:
    """(numpy element type, elements) of one key's or value's row in one kv head of a cache of
    format `fmt` (KV_TYPES' values): q8_0's rows are int8 codes then their blocks' float16
    scales as byte pairs (compiler/kernels/attention.py: cache_width)."""
    if fmt == "q8_0":
        return "int8", head_dim + head_dim // 16
    return fmt, head_dim


def is_int(v, lo: int | None = 0) -> bool:
    """An integer (Python's or numpy's, not a bool) of at least `lo` (None: any)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and (lo is None or v >= lo)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def max_threads() -> int:
    """The most worker threads qwc starts. TVM's pool spins while it waits, so every thread past
    the cores slows a step down (16 threads on 2 cores: 9x slower; 256 never finish)."""
    return max(8, 4 * usable_cpus())
