"""Perplexity with llama.cpp's protocol, and multiple choice scored by PMI.

Perplexity (llama.cpp `perplexity`): tokenize the whole text without BOS, cut it into
non-overlapping chunks of `ctx` tokens, run each chunk from an empty cache and score only its
second half (token j + 1 from the logits at j, for j from ctx/2 to ctx - 2), so every scored
token sees at least ctx/2 tokens of context. The ± is the standard error of the mean
negative log-likelihood carried through exp().

Multiple choice: for each option, log p(option | context) summed over the option's tokens.
PMI subtracts log p(option | neutral prefix), which removes how likely the option is on its
own (short, common sentences win plain likelihood); "norm" divides by the option's length
in characters (lm-evaluation-harness' acc_norm).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qwc import progress
from qwc.errors import QwcError

from .scorers import Scorer

NEUTRAL_PREFIX = "\n"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class Perplexity:
    ppl: float
    ppl_err: float
    nll: float
    chunks: int
    ctx: int
    scored_tokens: int
    tokens_per_s: float

    def __str__(self) -> str:
        return (f"perplexity {self.ppl:.4f} ± {self.ppl_err:.4f} over {self.chunks} chunks of {self.ctx} "
                f"({self.scored_tokens} scored tokens, {self.tokens_per_s:.1f} tok/s)")


def perplexity(scorer: Scorer, text: str, ctx: int = 512, chunks: int | None = None) -> Perplexity:
    if ctx < 4 or ctx % 2:
        raise QwcError(f"--ctx {ctx}: give an even number of at least 4 tokens")
    if ctx > scorer.max_ctx:
        raise QwcError(f"--ctx {ctx} exceeds the model's context of {scorer.max_ctx}")
    ids = scorer.encode(text)
    available = len(ids) // ctx
    if available == 0:
        raise QwcError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    n = available if chunks is None else min(chunks, available)
    first = ctx // 2
    nlls = []
    t0 = time.perf_counter()
    bar = progress.bar(range(n), desc="perplexity", unit="chunk")
    for c in bar:
        chunk = ids[c * ctx:(c + 1) * ctx]
        lp = log_softmax(scorer.logits(chunk)[first:ctx - 1])
        nlls.extend(-lp[np.arange(lp.shape[0]), chunk[first + 1:ctx]])
        bar.set_postfix(ppl=f"{math.exp(np.mean(nlls)):.3f}")
    dt = time.perf_counter() - t0
    nll = np.asarray(nlls)
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    return Perplexity(ppl=ppl, ppl_err=ppl * se, nll=mean, chunks=n, ctx=ctx, scored_tokens=len(nll),
                      tokens_per_s=n * ctx / dt)


@dataclass
class Choices:
    items: int
    acc_pmi: float
    acc_ll: float
    acc_ll_norm: float
    chance: float
    tokens_per_s: float

    def __str__(self) -> str:
        return (f"multiple choice over {self.items} items: PMI accuracy {self.acc_pmi:.4f}, "
                f"log-likelihood {self.acc_ll:.4f}, length-normalised {self.acc_ll_norm:.4f} "
                f"(chance {self.chance:.3f}; {self.tokens_per_s:.1f} tok/s)")


def read_choices(path: Path) -> list[dict]:
    items = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise QwcError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise QwcError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            it = json.loads(line)
            ok = (isinstance(it["context"], str) and it["context"].strip() and isinstance(it["options"], list) and len(it["options"]) >= 2
                  and all(isinstance(o, str) and o for o in it["options"])
                  and type(it["answer"]) is int and 0 <= it["answer"] < len(it["options"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise QwcError(f"{path}:{i}: expected {{\"context\": str, \"options\": [str, ...], \"answer\": index}}")
        items.append(it)
    if not items:
        raise QwcError(f"{path}: no items")
    return items


def _continuation_logprob(scorer: Scorer, prefix: list[int], option: list[int]) -> float:
    seq = prefix + option
    if len(seq) > scorer.max_ctx:
        raise QwcError(f"an item of {len(seq)} tokens exceeds the model's context of {scorer.max_ctx}")
    lp = log_softmax(scorer.logits(seq)[len(prefix) - 1:len(seq) - 1])
    return float(lp[np.arange(len(option)), option].sum())


def multiple_choice(scorer: Scorer, items: list[dict], neutral: str = NEUTRAL_PREFIX) -> Choices:
    """Context and options are tokenized apart and joined as ids, so an option's tokens are the
    same after the context and after the neutral prefix."""
    neutral_ids = scorer.encode(neutral)
    hits = {"pmi": 0, "ll": 0, "norm": 0}
    tokens = 0
    t0 = time.perf_counter()
    bar = progress.bar(items, desc="multiple choice", unit="item")
    for n, it in enumerate(bar, 1):
        ctx_ids = scorer.encode(it["context"])
        ll, pmi, norm = [], [], []
        for opt in it["options"]:
            o = scorer.encode(opt)
            cond = _continuation_logprob(scorer, ctx_ids, o)
            uncond = _continuation_logprob(scorer, neutral_ids, o)
            tokens += len(ctx_ids) + len(neutral_ids) + 2 * len(o)
            ll.append(cond)
            pmi.append(cond - uncond)
            norm.append(cond / len(opt))
        a = it["answer"]
        hits["ll"] += int(np.argmax(ll) == a)
        hits["pmi"] += int(np.argmax(pmi) == a)
        hits["norm"] += int(np.argmax(norm) == a)
        bar.set_postfix(pmi=f"{hits['pmi'] / n:.3f}")
    n = len(items)
    return Choices(items=n, acc_pmi=hits["pmi"] / n, acc_ll=hits["ll"] / n, acc_ll_norm=hits["norm"] / n,
                   chance=float(np.mean([1 / len(it["options"]) for it in items])),
                   tokens_per_s=tokens / (time.perf_counter() - t0))


def as_dict(result) -> dict:
    return asdict(result)
