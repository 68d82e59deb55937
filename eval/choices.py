"""A next-sentence multiple-choice set built from a novel (Persuasion is held out of training).

Each item: the `context_sentences` sentences before a target sentence, the true next
sentence, and distractors drawn from far away in the same novel with a similar length (so
length alone does not give the answer away). Options start with a space, as they would follow
the context in the text. Deterministic for a given text and seed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from qwc.errors import QwcError

_SENTENCE_END = re.compile(r'(?<=[.!?])["\u201d\']?\s+(?=["\u201c\']?[A-Z])')
_HEADING = re.compile(r"^(chapter|volume|finis|the end)\b", re.I)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs with their line breaks folded, headings dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        p = " ".join(block.split())
        if p and not _HEADING.match(p) and not p.isupper():
            out.append(p)
    return out


def sentences(text: str) -> list[tuple[int, str]]:
    """(paragraph index, sentence) in reading order."""
    out = []
    for i, p in enumerate(paragraphs(text)):
        for s in _SENTENCE_END.split(p):
            s = s.strip()
            if s:
                out.append((i, s))
    return out


def build_items(text: str, n: int = 200, options: int = 4, context_sentences: int = 3,
                seed: int = 0, min_chars: int = 30, max_chars: int = 250, min_distance: int = 100) -> list[dict]:
    sents = sentences(text)
    lengths = np.array([len(s) for _, s in sents])
    ok = (lengths >= min_chars) & (lengths <= max_chars)
    rng = np.random.default_rng(seed)
    candidates = [i for i in range(context_sentences, len(sents)) if ok[i]]
    if len(candidates) < n:
        raise QwcError(f"the text has {len(candidates)} usable sentences, fewer than the {n} items asked for")
    items = []
    for i in rng.permutation(candidates):
        if len(items) == n:
            break
        far = np.flatnonzero(ok & (np.abs(np.arange(len(sents)) - i) >= min_distance))
        # the distractors closest in length to the answer, picked at random among the nearest few
        nearest = far[np.argsort(np.abs(lengths[far] - lengths[i]), kind="stable")[:4 * options]]
        distract = rng.choice(nearest, size=options - 1, replace=False)
        opts = [" " + sents[i][1]] + [" " + sents[j][1] for j in distract]
        if len(set(opts)) < options:
            continue
        order = rng.permutation(options)
        items.append({
            "context": " ".join(s for _, s in sents[i - context_sentences:i]),
            "options": [opts[k] for k in order],
            "answer": int(np.flatnonzero(order == 0)[0]),
        })
    return items


def write_items(items: list[dict], path: Path) -> None:
    from qwc.atomic import check_replaceable, staging_dir

    path = Path(path)
    with staging_dir(path, foreign=foreign_items) as tmp:
        f = tmp / path.name
        f.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
        check_replaceable(path, foreign_items)
        f.replace(path)


def foreign_items(path: Path) -> str | None:
    """None if `path` is absent or a multiple-choice set (what this module writes), which may
    be replaced; anything else is a user's file (qwc.atomic)."""
    from .metrics import read_choices

    if not Path(path).exists():
        return None
    try:
        read_choices(path)
    except QwcError:
        return "it exists and is not a multiple-choice set qwc wrote"
    return None
