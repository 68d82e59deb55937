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
    # OpenAI's: subtracted from a token's logit once it was generated (presence) and per time
    # it was (frequency), over the generated tokens only, as OpenAI and vLLM count them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, [-100, 100]

    def __post_init__(self):
        def number(name, ok, want):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not ok(v):
                raise QwcError(f"{name} {v!r}: must be {want}")
        number("temperature", lambda v: v >= 0, "a finite number >= 0 (0: greedy)")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1: off)")
        number("repetition_penalty", lambda v: v > 0, "a finite number > 0 (1: off)")
        number("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2] (0: off)")
        number("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2] (0: off)")
        for k, v in (self.logit_bias or {}).items():
            if not is_int(k) or isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= v <= 100:
                raise QwcError(f"logit_bias {{{k!r}: {v!r}}}: token ids (integers >= 0) to numbers in [-100, 100]")
        if not is_int(self.top_k):
            raise QwcError(f"top_k {self.top_k!r}: must be an integer >= 0 (0: off)")
        if self.seed is not None and not (is_int(self.seed) and self.seed < 2**63):
            raise QwcError(f"seed {self.seed!r}: must be an integer in [0, 2**63) or None (random)")


class Sampler:
    """`limit`: only ids below it are sampled (the tokenizer's span, qwc/vocab.py: a padded
    vocabulary's extra rows are untrained and decode to nothing)."""

    def __init__(self, params: SamplingParams, limit: int | None = None, constraint=None):
        self.p = params
        self.limit = limit
        self.constraint = constraint   # runtime/grammar.py: Constraint, the grammar's allowed tokens
        self.rng = np.random.default_rng(params.seed)
        self.prompt_len = None   # history's length at the first call: the prompt (see __call__)
        bias = params.logit_bias or {}
        self.bias_ids = np.fromiter(bias, np.int64, len(bias))   # ids past the logits: skipped per call
        self.bias = np.fromiter(bias.values(), np.float64, len(bias))

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        """The next token after `history` (the prompt and every token generated since): the
        first call comes right after the prompt, so its history is the prompt, and the
        OpenAI penalties count only what follows it."""
        if self.prompt_len is None:
            self.prompt_len = len(history)
        x = logits[: self.limit].astype(np.float32)   # a copy: penalties and bias change it
        if self.bias.size:
            ok = self.bias_ids < x.size
            x[self.bias_ids[ok]] += self.bias[ok]
        if (self.p.presence_penalty or self.p.frequency_penalty) and len(history) > self.prompt_len:
            ids, counts = np.unique(np.asarray(history[self.prompt_len:], np.int64), return_counts=True)
            ok = ids < x.size
            x[ids[ok]] -= self.p.presence_penalty + self.p.frequency_penalty * counts[ok]
        if self.p.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, np.int64))
            seen = seen[seen < x.size]
            v = x[seen]
            x[seen] = np.where(v > 0, v / self.p.repetition_penalty, v * self.p.repetition_penalty)
        if self.constraint is None:
            return self._choose(x)
        # choose among the ids the grammar allows (the same distribution as masking the rest
        # to -inf, on a few ids where JSON's syntax allows a few)
        ids = np.flatnonzero(self.constraint.allowed()[: x.size])
        if not ids.size:
            raise QwcError("the grammar allows no token here")
        tok = int(ids[self._choose(x[ids])])
        self.constraint.consume(tok)
        return tok

    def _choose(self, x: np.ndarray) -> int:
        """Greedy, or a draw from softmax(x / temperature) cut to the top_k likeliest ids and
        to the smallest set holding top_p of the mass. A draw is one uniform number against the
        running sum (inverse CDF), in float32 but summed in float64; top-k and top-p work on the
        candidates only, not by sorting the vocabulary (a 152k vocabulary took 3-8 ms a token
        that way, on the scheduler's thread, for every sequence of a batched step)."""
        if self.p.temperature <= 0.0:
            return int(np.argmax(x))
        ids = None                      # the candidates' ids, where x holds only candidates
        if 0 < self.p.top_k < x.size:
            ids = np.argpartition(x, -self.p.top_k)[-self.p.top_k:]
            x = x[ids]
        # shifted first, and 1/temperature capped: a tiny temperature cannot overflow (0 * inf)
        probs = np.exp((x - x.max()) * np.float32(min(1.0 / self.p.temperature, 1e30)))
        if self.p.top_p < 1.0:
            keep = _top_p(probs, self.p.top_p)
            ids, probs = (keep if ids is None else ids[keep]), probs[keep]
        i = _draw(probs, self.rng.random())
        return int(i if ids is None else ids[i])


_BLOCK = 1024


def _draw(probs: np.ndarray, u: float) -> int:
    """The index i with probability probs[i] / sum(probs), for a uniform u in [0, 1): the
    inverse CDF in two levels, block sums then one block's running sum (a running sum over a
    152k vocabulary costs 0.5-1.2 ms)."""
    starts = np.arange(0, probs.size, _BLOCK)
    sums = np.cumsum(np.add.reduceat(probs, starts), dtype=np.float64)
    target = u * sums[-1]
    b = min(int(np.searchsorted(sums, target, side="right")), sums.size - 1)
    block = probs[starts[b]:starts[b] + _BLOCK]
    inner = np.cumsum(block, dtype=np.float64) + (sums[b - 1] if b else 0.0)
    i = int(np.searchsorted(inner, target, side="right"))
    if i >= block.size:   # the two sums' rounding: the block's last id that can be drawn
        i = int(np.flatnonzero(block)[-1])
    return int(starts[b]) + i


def _top_p(probs: np.ndarray, p: float) -> np.ndarray:
    """The indices of the likeliest entries of `probs` (not normalised) whose sum first reaches
    p of the total, likeliest first. If the entries of at least some value t hold p of the
    mass, the set is among them: so only those are sorted, t lowered until they do."""
    need, t = p * float(probs.sum(dtype=np.float64)), float(probs.max()) * 1e-4
    while True:
        cand = np.flatnonzero(probs >= t)
        if t == 0.0 or float(probs[cand].sum(dtype=np.float64)) >= need:
            break
        t = t * 1e-4 if t > 1e-30 else 0.0
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order], dtype=np.float64)
    return order[: int(np.searchsorted(cum, need)) + 1]


def logprobs(logits: np.ndarray, tok: int, top: int, limit: int | None = None) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `tok` under the model's distribution (the raw logits, before
    penalties, bias, grammar and temperature, as OpenAI and vLLM report it), and the `top`
    most likely ids with theirs, most likely first."""
    x = logits[:limit].astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best = []
    if top > 0:
        ids = np.argpartition(-x, top - 1)[:top] if top < x.size else np.arange(x.size)
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = [(int(i), float(x[i] - lse)) for i in ids]
    return float(x[tok] - lse), best
