"""Training text for `qwc lora`: plain text, or chat conversations in JSONL.

A plain text file (or `austen:<novel>`) is one token stream, every token a target.

A `.jsonl` file holds one conversation a line, `{"messages": [{"role": ..., "content": ...}, ...]}`
(the OpenAI / llama-factory "sharegpt-openai" shape). Each is rendered with the model's chat
template, and only the assistant turns' tokens are targets: the prompt is context, as in
llama-factory's and TRL's default. An assistant turn spans the characters between the render of
the conversation before it (with the generation prompt) and the render that includes it; the
template must render a conversation's turns as prefixes of each other, as ChatML does.

Conversations are packed one after another into one stream, so training samples windows of it
exactly as it does plain text.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from qwc.errors import QwcError


def read_stream(paths: list[Path], tokenizer, chat_template: str | None) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(token ids, target mask, a digest of the texts) of every file, concatenated."""
    from qwc.text import read_text

    ids, masks, digest = [], [], hashlib.sha256()
    for p in paths:
        text = read_text(p)
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
        if Path(p).suffix.lower() == ".jsonl":
            t, m = _chat_stream(Path(p), text, tokenizer, chat_template)
        else:
            t = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
            m = np.ones(len(t), bool)
        ids.append(t)
        masks.append(m)
    return np.concatenate(ids), np.concatenate(masks), digest.digest()


def read_training_data(paths: list[Path], tokenizer, chat_template: str | None, seq_len: int):
    """read_stream, refusing a text shorter than one training sequence."""
    tokens, mask, digest = read_stream(paths, tokenizer, chat_template)
    if len(tokens) < seq_len + 2:
        raise QwcError(f"{', '.join(map(str, paths))}: {len(tokens)} tokens, fewer than one sequence of {seq_len}")
    return tokens, mask, digest


def _chat_stream(path: Path, text: str, tokenizer, chat_template: str | None):
    from qwc.chat_template import ChatTemplate

    if not chat_template:
        raise QwcError(f"{path}: chat data needs the model's chat template, and this model has none")
    template = ChatTemplate(chat_template)
    ids, mask = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        messages = _messages(path, n, line)
        rendered, spans = _render_turns(template, messages, f"{path}:{n}")
        enc = tokenizer.encode(rendered, add_special_tokens=False)
        starts = np.asarray([a for a, _ in enc.offsets])
        m = np.zeros(len(enc.ids), bool)
        for a, b in spans:
            m |= (starts >= a) & (starts < b)
        ids.append(np.asarray(enc.ids, np.int64))
        mask.append(m)
    if not ids:
        raise QwcError(f"{path}: no conversations")
    if not any(m.any() for m in mask):
        raise QwcError(f"{path}: no assistant turn to learn from")
    return np.concatenate(ids), np.concatenate(mask)


def _messages(path: Path, n: int, line: str) -> list[dict]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise QwcError(f"{path}:{n}: not JSON ({e.msg})") from None
    messages = rec.get("messages") if isinstance(rec, dict) else None
    if not isinstance(messages, list) or not messages:
        raise QwcError(f"{path}:{n}: expected {{\"messages\": [...]}} with at least one message")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)):
            raise QwcError(f"{path}:{n}: each message needs a role (system, user, assistant) and string content")
    return messages


def _render_turns(template, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation rendered, and the character spans of its assistant turns."""
    full = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True) if i else ""
        through = template.render(messages[:i + 1], add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise QwcError(f"{where}: the chat template does not render turns as prefixes of the conversation; "
                           "give the text as plain text instead")
        spans.append((len(before), len(through)))
    return full, spans
