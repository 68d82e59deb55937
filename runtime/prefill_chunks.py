"""How a prompt is cut into prefill calls: shared by the engine (one prompt's calls) and the
scheduler (one chunk a step), which must cut it the same way."""

from __future__ import annotations


def next_chunk(remaining: int, most: int) -> int:
    """How many of `remaining` prompt tokens the next prefill call takes, at most `most`:
    never a lone token where it can be helped. One token runs decode's kernels (three-pass
    attention), a chunk the prefill kernels (online attention), whose rounding differs; so
    without this a prompt's logits, and a greedy reply, would depend on where its chunks fall
    (a prompt of 257 tokens in calls of 256, the rest of a prefix-cache hit)."""
    n = min(remaining, most)
    return n - 1 if remaining - n == 1 and n > 2 else n
