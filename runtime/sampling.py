"""Token sampling on a logits vector (numpy only)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from qwc.errors import QwcError
from qwc.limits import is_int


@dataclass
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    repetition_penalty: float = 1.0  # 1: off (llama.cpp / HF semantics)
    seed: int | None = None

    def __post_init__(self):
        def number(name, ok, want):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not ok(v):
                raise QwcError(f"{name} {v!r}: must be {want}")
        number("temperature", lambda v: v >= 0, "a finite number >= 0 (0: greedy)")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1: off)")
        number("repetition_penalty", lambda v: v > 0, "a finite number > 0 (1: off)")
        if not is_int(self.top_k):
            raise QwcError(f"top_k {self.top_k!r}: must be an integer >= 0 (0: off)")
        if self.seed is not None and not (is_int(self.seed) and self.seed < 2**63):
            raise QwcError(f"seed {self.seed!r}: must be an integer in [0, 2**63) or None (random)")


class Sampler:
    """`limit`: only ids below it are sampled (the tokenizer's span, qwc/vocab.py: a padded
    vocabulary's extra rows are untrained and decode to nothing)."""

    def __init__(self, params: SamplingParams, limit: int | None = None):
        self.p = params
        self.limit = limit
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        x = logits[: self.limit].astype(np.float64)
        if self.p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, np.int64))
            seen = seen[seen < x.size]
            v = x[seen]
            x[seen] = np.where(v > 0, v / self.p.repetition_penalty, v * self.p.repetition_penalty)
        if self.p.temperature <= 0.0:
            return int(np.argmax(x))
        x = (x - x.max()) / self.p.temperature   # shifted first: a tiny temperature cannot overflow
        if self.p.top_k > 0 and self.p.top_k < x.size:
            kth = np.partition(x, -self.p.top_k)[-self.p.top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if self.p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.p.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))
