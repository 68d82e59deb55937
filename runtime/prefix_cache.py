"""Which idle KV-cache row a new request runs in, and which cached prompt it reuses: the policy of
prefix reuse (llama-server's prompt cache), on row numbers only, so it is tested without a model.

An idle row keeps the tokens of the request it last ran, with the adapter they were computed
with (every layer's keys and values depend on it, so a prefix is reused only by the same one).
A new request runs in the lowest idle row, because a batched step computes every row up to the
highest running one. If some idle row holds at least `min_reuse` tokens of its prompt, the
longest such prefix is swapped down into that row; otherwise what that row holds moves to the
idle row whose cache was used least recently (or holds nothing), if that one is older. So
caches live as long as idle rows can keep them, and eviction is least recently used.

The scheduler applies the `Placement`'s moves to the pool (runtime/scheduler.py: Scheduler._place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Move:
    """A cache row's tokens going to another row: "swap" exchanges two rows' first `n` positions,
    "copy" writes `n` positions of `src` over `dst`."""
    kind: str
    src: int
    dst: int
    n: int


@dataclass
class Placement:
    row: int                 # where the request runs
    keep: int                # prompt tokens already in that row's cache
    moves: list[Move] = field(default_factory=list)   # to apply to the pool first, in order


class PrefixCache:
    def __init__(self, min_reuse: int | None = 16):
        self.min_reuse = min_reuse            # None: no reuse
        self.tokens: dict[int, list[int]] = {}   # idle row -> the tokens its cache holds
        self.adapter: dict[int, int] = {}        # idle row -> the adapter those were computed with
        self.used: dict[int, int] = {}           # row -> when it last finished a request (a count)
        self._finished = 0

    def held(self, row: int) -> list[int]:
        """The tokens an idle row's cache holds (positions past them are stale)."""
        return self.tokens.get(row, [])

    def forget(self) -> None:
        """Every row's contents unknown (written by something else)."""
        self.tokens.clear()
        self.adapter.clear()

    def place(self, free: list[int], prompt: list[int], adapter: int = 0) -> Placement:
        """Where a request with `prompt` and `adapter` runs among the idle rows `free` (which it
        takes out of), and how many prompt tokens it finds there. Ties in the longest prefix go
        to the earliest row in `free`'s order, after the row it runs in."""
        row = min(free)
        free.remove(row)
        out = Placement(row, 0)
        if self.min_reuse is not None:
            def reusable(r: int) -> list[int]:
                return self.tokens.get(r, []) if self.adapter.get(r, 0) == adapter else []
            src = max([row, *free], key=lambda r: common_prefix(reusable(r), prompt))
            # at least two prompt tokens are prefilled (prefill_chunks.next_chunk: one alone would run
            # decode's kernels): the last one's logits give the first new token
            n = min(common_prefix(reusable(src), prompt), len(prompt) - 2)
            if n >= self.min_reuse:
                out.keep = n
                if src != row:   # the prefix comes down to this row, what it held goes up
                    out.moves.append(self._swap(row, src))
        if not out.keep:
            out.moves.extend(self._keep_elsewhere(row, free))
        self.tokens.pop(row, None)
        self.adapter.pop(row, None)
        return out

    def finished(self, row: int, tokens: list[int], adapter: int) -> None:
        """A request left `row` with `tokens` in its cache."""
        self.tokens[row] = tokens
        self.adapter[row] = adapter
        self._finished += 1
        self.used[row] = self._finished

    def _swap(self, a: int, b: int) -> Move:
        ta, tb = self.tokens.get(a, []), self.tokens.get(b, [])
        self.tokens[a], self.tokens[b] = tb, ta
        ad = self.adapter
        ad[a], ad[b] = ad.get(b, 0), ad.get(a, 0)
        self.used[a], self.used[b] = self.used.get(b, -1), self.used.get(a, -1)
        return Move("swap", a, b, max(len(ta), len(tb)))

    def _keep_elsewhere(self, row: int, free: list[int]) -> list[Move]:
        """Before `row`'s cache is overwritten, move what it holds to the idle row that holds the
        oldest (or nothing), if that is older."""
        mine = self.tokens.get(row)
        if not mine or not free:
            return []
        def age(r: int) -> int:
            return self.used[r] if self.tokens.get(r) else -1   # an empty row is oldest
        other = min(free, key=age)
        if age(other) >= self.used[row]:
            return []
        self.tokens[other], self.used[other] = mine, self.used[row]
        self.adapter[other] = self.adapter.get(row, 0)
        return [Move("copy", row, other, len(mine))]


def common_prefix(a, b) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(neq[0]) if neq.size else n
