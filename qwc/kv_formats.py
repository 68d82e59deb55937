"""The KV cache's formats, as the CLI names them and as the manifest and the runtime's buffers
hold them. The kernels that read and write them: compiler/kernels/kv_cache.py."""

from __future__ import annotations

# `qwc compile --kv-dtype` (llama.cpp's -ctk / -ctv names) -> the KV cache's format, as the
# manifest records it (q8_0: llama.cpp's blocks of 32 int8 and a float16 scale)
KV_TYPES = {"f32": "float32", "f16": "float16", "q8_0": "q8_0"}


def cache_row(fmt: str, head_dim: int) -> tuple[str, int]:
    """(numpy element type, elements) of one key's or value's row in one kv head of a cache of
    format `fmt` (KV_TYPES' values): q8_0's rows are int8 codes then their blocks' float16
    scales as byte pairs (compiler/kernels/kv_cache.py: cache_width)."""
    if fmt == "q8_0":
        return "int8", head_dim + head_dim // 16
    return fmt, head_dim
