"""The context a sequence gets when the user names none (`qwc serve`, `qwc run` without --ctx).

llama-server takes the model's trained context when `-c` is not given; qwc does the same, so
a model trained on fewer positions than a fixed default starts instead of being refused. A
server commits its KV caches at start (every slot's, for the whole context), so the choice is
capped where those caches would take more than a share of the memory available then; the
cap is a multiple of CONTEXT_STEP. An explicit --ctx beyond the model's positions stays an
error (runtime/engine.py).
"""

from __future__ import annotations

import numpy as np

from qwc.kv_formats import cache_row
from qwc.memory_check import available_bytes

KV_SHARE = 0.5       # of the memory available at start, at most, for the caches committed then
CONTEXT_STEP = 256   # a capped context is a multiple of this


def kv_bytes_per_token(manifest) -> int:
    """KV-cache bytes one position of one sequence takes in the artifact's cache format."""
    cfg = manifest.model
    element, width = cache_row(manifest.functions.cache_dtype, cfg.head_dim)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * width * np.dtype(element).itemsize


def default_context(manifest, sequences: int, cap: int | None = None, available: int | None = None) -> tuple[int, str]:
    """(positions a sequence, why) for `sequences` caches: the model's trained context, no more
    than `cap` (`qwc run`'s short default), and no more than KV_SHARE of the available memory
    (`available`, default: what the machine has now) allows."""
    trained = manifest.model.context_length
    ctx, why = trained, "the model's trained context"
    if cap is not None and cap < ctx:
        ctx, why = cap, f"the default, under the model's {trained} positions"
    room = available_bytes() if available is None else available
    if room is not None:
        fits = int(room * KV_SHARE) // (kv_bytes_per_token(manifest) * max(1, sequences))
        if fits < ctx:
            ctx = max(CONTEXT_STEP, fits // CONTEXT_STEP * CONTEXT_STEP)
            ctx = min(ctx, trained)
            why = (f"the model's {trained} positions capped by memory: {sequences} sequence caches in at most "
                   f"{KV_SHARE:.0%} of the {room / 2**30:.1f} GiB available")
    return ctx, why
