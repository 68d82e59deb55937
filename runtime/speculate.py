"""Speculative decoding's drafts: by prompt lookup, the tokens that followed the latest earlier
occurrence of the context's last n-gram (vLLM's "ngram" method, llama.cpp's lookup decoding);
or by a smaller model with the same vocabulary, greedily (`qwc serve --draft`).

Prompt lookup needs no second model: a reply that quotes its prompt (a summary, an edit of
code or text, an extraction, a JSON answer over given fields) repeats long runs of tokens the
context already holds. Either way the scheduler verifies a draft in one call of the artifact's
`verify` entry point (the last sampled token and the draft, every position's logits, each the
decode step's to the bit: Engine.verify) and keeps the longest prefix the sampler itself would
have produced (runtime/scheduler.py: Scheduler._verify): sampled replies follow the same
distribution as without drafts, greedy ones are the same token for token (on x86; on ARM the
logits agree to ~1e-6, docs/design.md).
"""

from __future__ import annotations

import numpy as np

from qwc.errors import QwcError
from qwc.limits import DRAFT_MAX

# A verify call of k + 1 tokens costs more than a decode step and grows with k, slowly until
# the ninth token leaves decode's streams for prefill's tiles, hence DRAFT_MAX (qwc/limits.py).
# So a draft pays only where its tokens are often right (docs/history/serving.md, "Prompt
# lookup").
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

    def draft(self, history: list[int], limit: int | None = None, prompt: int | None = None) -> list[int]:
        """Up to min(draft_max, limit) tokens to follow `history` (the prompt and every token
        generated, which only ever grows), or [] where its last n-grams occurred nowhere
        before. `prompt` (the prompt's length, which a draft model needs) is not read."""
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
        self.length = next_length(self.draft_max, n)


def next_length(draft_max: int, n: int) -> int:
    """A draft's length after the last one kept n tokens: 2n + 2, at least 2, at most draft_max."""
    return max(2, min(draft_max, 2 * n + 2))


class DraftModel:
    """A smaller model drafting for the served one (`qwc serve --draft SMALL.qwc`): the tokens
    its greedy decoding gives after the context. A drafter per request (calling the model
    makes one), each with a cache of its own in the draft engine; the caches are reused from
    request to request. The draft engine runs on the scheduler's thread, between the served
    model's steps."""

    def __init__(self, engine, target, draft_max: int = DRAFT_MAX):
        if draft_max < 1:
            raise QwcError(f"speculation: draft_max ({draft_max}) must be at least 1")
        if not same_vocabulary(engine, target):
            raise QwcError(f"--draft {engine.path}: its tokenizer is not the served model's (a draft's tokens "
                           "must mean the same to both)")
        self.engine, self.draft_max = engine, draft_max
        self.limit = min(engine.sample_limit, target.sample_limit)   # ids both models can sample
        self._free: list = []   # caches of finished requests

    def __call__(self) -> ModelDrafter:
        return ModelDrafter(self)


def same_vocabulary(a, b) -> bool:
    """Whether two engines' tokenizers map the same strings to the same ids (without
    tokenizers: whether their vocabularies are the same size)."""
    if a.tokenizer is None or b.tokenizer is None:
        return a.tokenizer is None and b.tokenizer is None and a.vocab_size == b.vocab_size
    return a.tokenizer.get_vocab(with_added_tokens=True) == b.tokenizer.get_vocab(with_added_tokens=True)


class ModelDrafter:
    """Drafts for one sequence from the draft model. Its cache holds `_fed`, the tokens of the
    history it was given and of its own last draft; a new draft sets the cache back to what
    that shares with the history (the draft tokens that were not kept go), feeds the rest of
    the history (the prompt's tokens in a prefill, the generated ones through verify), and
    decodes greedily from there."""

    def __init__(self, model: DraftModel):
        self.model = model
        self.length = model.draft_max
        self.seq = None
        self._fed: list[int] = []

    def draft(self, history: list[int], limit: int | None = None, prompt: int | None = None) -> list[int]:
        """`prompt`: how many of history's first tokens are the request's prompt (None: all)."""
        k = self.length if limit is None else min(self.length, limit)
        if k <= 0 or not history:
            return []
        eng = self.model.engine
        if self.seq is None:
            self.seq = self.model._free.pop() if self.model._free else eng.sequence()
            self.seq.pos, self._fed = 0, []
        if len(history) + k > self.seq.capacity:
            return []
        same = 0
        for a, b in zip(self._fed, history):
            if a != b:
                break
            same += 1
        same = min(same, len(history) - 1)   # the last token is fed again: its logits come next
        self.seq.pos, new = same, history[same:]
        # The prompt's tokens as the served model took them, a prefill; the generated ones
        # (which it decoded or verified) through verify, in decode's arithmetic, not as a
        # prompt chunk (whose attention on a float16 cache rounds its operands): so the
        # drafts follow its steps
        cut = len(new) if prompt is None else min(max(prompt - same, 0), len(new))   # the prompt's
        if cut == 1:   # a lone prompt token goes with the generated ones (a prefill never takes one)
            cut = 0
        if cut:
            logits = eng.prefill(new[:cut], seq=self.seq)
        rest = new[cut:]
        if rest:
            logits = eng.decode(rest[0], seq=self.seq) if len(rest) == 1 else eng.verify(rest, seq=self.seq)[-1]
        self._fed = list(history)
        out = []
        for i in range(k):
            tok = int(np.argmax(logits[:self.model.limit]))
            out.append(tok)
            if i + 1 < k:
                logits = eng.decode(tok, seq=self.seq)
                self._fed.append(tok)
        return out

    def kept(self, n: int) -> None:
        self.length = next_length(self.model.draft_max, n)

    def close(self) -> None:
        """The request is done: its cache goes back to the model for the next."""
        if self.seq is not None:
            self.model._free.append(self.seq)
            self.seq = None
