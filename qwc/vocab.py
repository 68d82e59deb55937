"""The tokenizer against the model's vocabulary: which ids can be sampled, and when to warn.

Qwen2.5 pads its embedding past the tokenizer by design (151,665 tokens in 151,936 or 152,064
rows): the padding rows are never trained, so their logits are noise and an id there decodes
to nothing. The runtime samples only ids the tokenizer has; a gap larger than such padding
(a wrong tokenizer beside the weights) is worth a warning at export and at load.
"""

from __future__ import annotations

PADDING_ROWS = 1024   # the most rows a checkpoint pads its vocabulary by before qwc warns


def token_span(tokenizer) -> int:
    """1 + the largest id the tokenizer (a tokenizers.Tokenizer) can produce, added tokens included."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(ids) + 1 if ids else 0


def mismatch(vocab_size: int, span: int) -> str | None:
    """A one-line warning when tokenizer and vocabulary do not belong together, else None."""
    if span > vocab_size:
        return (f"the tokenizer has ids up to {span - 1}, past the model's vocabulary of {vocab_size}: "
                "is it the model's own tokenizer?")
    if vocab_size - span > PADDING_ROWS:
        return (f"the tokenizer covers {span} of the model's {vocab_size} vocabulary rows; ids past it "
                "are never sampled. Is it the model's own tokenizer?")
    return None
