"""Speculative decoding's drafts by prompt lookup: the tokens that followed the latest earlier
occurrence of the context's last n-gram (vLLM's "ngram" method, llama.cpp's lookup decoding).

No second model: a reply that quotes its prompt (a summary, an edit of code or text, an
extraction, a JSON answer over given fields) repeats long runs of tokens the context already
holds. The scheduler verifies a draft in one call of the artifact's `score` entry point (the
last sampled token and the draft, every position's logits) and keeps the longest prefix the
sampler itself would have produced (runtime/scheduler.py: Scheduler._verify): sampled replies
follow the same distribution as without drafts, greedy ones are the same up to near ties (the
verify call runs the prefill kernels, whose rounding differs from the decode step's).
"""

from __future__ import annotations

from qwc.errors import QwcError

# A verify call of k + 1 tokens costs 1.8-1.9 decode steps at k = 1, 2.3-2.4 at k = 4 and 3.0-3.3
# at k = 8 on the Qwen2.5-0.5B to 7B shapes (x86, 2 threads; most of it is the call's fixed
# cost), so a draft pays where its tokens are right with a probability above ~0.6 each.
# docs/results.md, "Speculative decoding by prompt lookup".
DRAFT_MAX = 8      # tokens a draft proposes at most
NGRAM_MAX = 4      # the longest context suffix looked up first
NGRAM_MIN = 3      # the shortest (2-grams matched more often and were right less often, in a trial on SmolLM2)


class NgramDrafter:
    """Drafts for one sequence. The index maps each n-gram (NGRAM_MIN <= n <= NGRAM_MAX) of the
    history to where its latest occurrence ends; it grows with the history, so a draft costs
    a few dictionary lookups, not a scan of the context."""

    def __init__(self, draft_max: int = DRAFT_MAX, ngram_max: int | None = None, ngram_min: int = NGRAM_MIN):
        """`ngram_max` None: NGRAM_MAX, or ngram_min where that is longer."""
        ngram_max = max(NGRAM_MAX, ngram_min) if ngram_max is None else ngram_max
        if not 1 <= ngram_min <= ngram_max or draft_max < 1:
            raise QwcError(f"speculation: need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max}) "
                           f"and draft_max ({draft_max}) >= 1")
        self.draft_max, self.ngram_max, self.ngram_min = draft_max, ngram_max, ngram_min
        self.length = draft_max             # this draft's length: twice what the last one kept, plus 2
        self._ends: dict[tuple, int] = {}   # n-gram -> index of its last token, latest occurrence
        self._indexed = 0                   # history[:_indexed] is in _ends

    def _index(self, history: list[int], upto: int) -> None:
        for end in range(self._indexed, upto):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self._ends[tuple(history[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def draft(self, history: list[int], limit: int | None = None) -> list[int]:
        """Up to min(draft_max, limit) tokens to follow `history` (the prompt and every token
        generated, which only ever grows), or [] where its last n-grams occurred nowhere
        before."""
        k = self.length if limit is None else min(self.length, limit)
        if k <= 0 or len(history) < self.ngram_min + 1:
            return []
        self._index(history, len(history) - 1)   # occurrences ending before the last token
        for n in range(min(self.ngram_max, len(history) - 1), self.ngram_min - 1, -1):
            end = self._ends.get(tuple(history[-n:]))
            if end is not None:
                return list(history[end + 1:end + 1 + k])
        return []

    def kept(self, n: int) -> None:
        """The last draft's first n tokens were kept: the next is as long as 2n + 2 (at most
        draft_max), short after a miss (a long wrong draft costs more than a short one) and
        long while a quote goes on."""
        self.length = max(2, min(self.draft_max, 2 * n + 2))
