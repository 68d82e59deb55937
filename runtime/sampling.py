"""Token sampling on a logits vector (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    repetition_penalty: float = 1.0  # 1: off (llama.cpp / HF semantics)
    seed: int | None = None


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        x = logits.astype(np.float64).copy()
        if self.p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, np.int64))
            seen = seen[seen < x.size]
            v = x[seen]
            x[seen] = np.where(v > 0, v / self.p.repetition_penalty, v * self.p.repetition_penalty)
        if self.p.temperature <= 0.0:
            return int(np.argmax(x))
        x /= self.p.temperature
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
