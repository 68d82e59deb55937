"""Bounds on what a user may ask for, shared by the CLI and the runtime's API."""

from __future__ import annotations

import numbers

MAX_LORA_RANK = 256   # `qwc compile --max-lora-rank`: the largest adapter rank slots take
MAX_BATCH = 256   # `qwc compile --max-batch`: sequences one batched decode step may carry
# `--draft-max`'s default: tokens a speculative draft proposes at most. With the token before it
# a verify call then has 8 tokens, the most the x86 GEMM takes in decode's streams (x86/vnni.py:
# FEW_TOKENS); a ninth token puts the call on prefill's tiles, which cost a step more
# (docs/history/serving.md has the costs).
DRAFT_MAX = 7


def is_int(v, lo: int | None = 0) -> bool:
    """An integer (Python's or numpy's, not a bool) of at least `lo` (None: any)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and (lo is None or v >= lo)
