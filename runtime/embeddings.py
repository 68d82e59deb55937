"""Embeddings: each input's final hidden state (after the model's last norm) pooled into one
vector and L2-normalized, as OpenAI's are; `qwc serve`'s /v1/embeddings and Engine.embed.

Pooling follows llama-server's names: "last" (the last token's state: what a decoder LLM's
embedding models, Qwen3-Embedding among them, are trained to read), "mean" (the average of
every token's) and "cls" (the first token's). The artifact's `embed` entry point returns every
position's state of a chunk; `embed_step` (artifacts compiled with --max-batch >= 2) the states
of the tokens it is asked for, of several sequences in one call, so a list of inputs reads the
weights once a call rather than once an input (compiler/build.py).

This module is the policy, on token counts and arrays only, so it is tested without a model:
which rows of the cache each input runs in, how its tokens are cut into calls of at most
`max_tokens` (an input longer than a call continues in the next, after what its row holds), which
of a chunk's states a pooling needs, and how they add up. The scheduler runs a job a call at a
time between its generation steps (runtime/scheduler.py: Scheduler._embed_round)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import numpy as np

POOLINGS = ("last", "mean", "cls")
DEFAULT_POOLING = "last"


def needed_rows(pooling: str, start: int, n: int, total: int) -> list[int]:
    """The positions (0..n-1) of a chunk of `n` tokens starting at token `start` of an input of
    `total` that `pooling` reads: every one for mean, the input's first for cls, its last for last."""
    if pooling == "mean":
        return list(range(n))
    if pooling == "cls":
        return [0] if start == 0 else []
    return [n - 1] if start + n == total else []


@dataclass
class Part:
    """One input's chunk in one call: it runs in cache row `row` after `start` tokens."""
    index: int          # the input's position in the job
    row: int
    start: int
    tokens: list[int]
    rows: list[int]     # the chunk's positions whose states the pooling reads


@dataclass
class EmbeddingJob:
    """A request's inputs (token ids each), pooled by `pooling`, with the adapter of slot
    `adapter`. The scheduler's thread plans and runs it; the caller waits on `done`."""
    inputs: list[list[int]]
    pooling: str = DEFAULT_POOLING
    adapter: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    t_submit: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r}: one of {', '.join(POOLINGS)}")
        self._waiting = collections.deque(range(len(self.inputs)))
        self._fed = [0] * len(self.inputs)
        self._rows: dict[int, int] = {}          # input -> its cache row, while it runs
        self._sums: list[np.ndarray | None] = [None] * len(self.inputs)
        self.vectors: np.ndarray | None = None   # [inputs, hidden], normalized: the result

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.inputs)

    @property
    def holding(self) -> dict[int, int]:
        """Row -> input, of the inputs that are part-way through (their rows hold their tokens)."""
        return {r: i for i, r in self._rows.items()}

    def plan(self, free_rows: list[int], max_tokens: int, max_parts: int) -> list[Part]:
        """The next call: the inputs part-way through first (in the rows they hold), then new
        ones in `free_rows` (lowest first), each as much of its rest as fits `max_tokens` in all,
        at most `max_parts` inputs."""
        parts: list[Part] = []
        budget = max_tokens
        running = sorted(self._rows.items(), key=lambda x: x[0])
        free = sorted(free_rows)
        while budget > 0 and len(parts) < max_parts:
            if running:
                i, row = running.pop(0)
            elif self._waiting and free:
                i, row = self._waiting.popleft(), free.pop(0)
                self._rows[i] = row
            else:
                break
            start = self._fed[i]
            n = min(len(self.inputs[i]) - start, budget)
            parts.append(Part(i, row, start, self.inputs[i][start:start + n],
                              needed_rows(self.pooling, start, n, len(self.inputs[i]))))
            budget -= n
        return parts

    def add(self, parts: list[Part], states: list[np.ndarray]) -> list[int]:
        """Each part's states (float32 [len(part.rows), hidden]) taken in; returns the rows whose
        inputs ended in this call (free again)."""
        freed = []
        for p, s in zip(parts, states):
            if len(p.rows):
                total = np.asarray(s, np.float64).sum(0)
                self._sums[p.index] = total if self._sums[p.index] is None else self._sums[p.index] + total
            self._fed[p.index] += len(p.tokens)
            if self._fed[p.index] == len(self.inputs[p.index]):
                freed.append(self._rows.pop(p.index))
        if self.finished:
            self.vectors = np.stack([self._pooled(i) for i in range(len(self.inputs))])
        return freed

    @property
    def finished(self) -> bool:
        return not self._waiting and not self._rows

    def _pooled(self, i: int) -> np.ndarray:
        v = self._sums[i] / (len(self.inputs[i]) if self.pooling == "mean" else 1)
        return normalized(v)

    def fail(self, reason: str) -> None:
        self.error = reason
        self.done.set()


def normalized(v: np.ndarray) -> np.ndarray:
    """v / |v| in float32 (a zero vector stays zero)."""
    n = float(np.linalg.norm(v))
    return (v / n if n > 0 else v).astype(np.float32)
