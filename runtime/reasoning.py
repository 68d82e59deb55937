"""A reasoning model's thinking, apart from its answer: Qwen3 writes `<think>…</think>` before
the reply, and the server returns what is inside as `reasoning_content` (vLLM's reasoning
parser, llama-server's `--reasoning-format deepseek`), or leaves it in the text (`none`).

A reply thinks when the chat template has a think block (`template_thinks`). Where the
rendered prompt already ends with `<think>` (templates that open the block for the model)
the reply starts inside it; where it ends with an empty block (Qwen3's `enable_thinking`
false) the reply is all answer. A grammar (response_format, a tool call) constrains the
answer only: `thinking_grammar` lets the model think freely first.
"""

from __future__ import annotations

import json

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("auto", "deepseek", "none")   # llama-server's --reasoning-format (auto: deepseek's split)


def template_thinks(template: str | None) -> bool:
    """Does the chat template write think blocks (so its model's replies may hold one)?"""
    return bool(template) and CLOSE in template


def opens_thinking(prompt: str) -> bool:
    """The rendered prompt leaves the model inside a think block: its reply is thinking until
    </think>."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def closes_thinking(prompt: str) -> bool:
    """The rendered prompt ends with a closed think block (Qwen3's enable_thinking false): the
    reply is all answer."""
    return prompt.rstrip().endswith(CLOSE)


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(the reasoning, the answer) of a whole reply; `inside`: the reply began inside the
    block. A reply that never closes its block (cut by max_tokens) is all reasoning; one that
    opens none is all answer (None: no reasoning)."""
    body = text
    if not inside:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        body = stripped[len(OPEN):]
    head, closed, tail = body.partition(CLOSE)
    if not closed:
        return head.strip("\n"), ""
    return head.strip("\n"), tail.lstrip(" \n")


class ReasoningStream:
    """A streamed reply split as it comes: `feed` returns (reasoning, answer) pieces that are
    sure; text that may be the start of a marker is held back until the next piece."""

    def __init__(self, inside: bool = False):
        # "start": not yet known whether the reply opens a block; "think"; "answer"
        self.state = "think" if inside else "start"
        self.held = ""
        self.fresh = True   # the next reasoning / answer piece is the first: leading newlines dropped

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        reasoning, answer = "", ""
        while True:
            if self.state == "start":
                s = self.held.lstrip()
                if s.startswith(OPEN):
                    self.held, self.state, self.fresh = s[len(OPEN):], "think", True
                    continue
                if OPEN.startswith(s):   # (all whitespace, or a part of the marker): wait
                    return reasoning, answer
                self.state, self.fresh = "answer", False
                continue
            if self.state == "think":
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning += self._lead(self.held[:at].rstrip("\n"))
                    self.held, self.state, self.fresh = self.held[at + len(CLOSE):], "answer", True
                    continue
                # a part of </think> at the end, and the newlines before it (the block's, not
                # the reasoning's), are held back
                cut = len(self.held) - _partial_suffix(self.held, CLOSE)
                cut = len(self.held[:cut].rstrip("\n"))
                out, self.held = self.held[:cut], self.held[cut:]
                return reasoning + self._lead(out), answer
            out, self.held = self.held, ""
            return reasoning, answer + self._lead(out)

    def _lead(self, s: str) -> str:
        """s without the newlines that follow a marker (and after </think>, the spaces too, as
        split_reasoning drops them), while nothing of its part was shown."""
        if self.fresh:
            s = s.lstrip(" \n" if self.state == "answer" else "\n")
            self.fresh = not s
        return s

    def finish(self) -> tuple[str, str]:
        """What was held back at the reply's end."""
        rest, self.held = self.held, ""
        if self.state == "think":
            return self._lead(rest).rstrip("\n"), ""
        return "", rest


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def thinking_grammar(answer: str, vocab, inside: bool) -> str:
    """The grammar of a reply that may think and then gives `answer` (an llguidance grammar):
    free text in the block (`inside`: the reply begins in it), the grammar after it."""
    close = vocab.marker(CLOSE)
    if close.startswith("<["):
        thought, block = "thought: /(?s:.*)/", f"thought {close}"
    else:   # stop= ends the text at the marker, which it takes itself
        thought, block = f"thought[stop={json.dumps(CLOSE)}]: /(?s:.*)/", "thought"
    block = block if inside else f"({vocab.marker(OPEN)} {block})?"   # the model may answer without thinking
    # (the whitespace after the block bounded: unbounded, a model can wander into it for ever)
    lark = f"start: {block} /[ \\n]{{0,4}}/ @answer\n{thought}\n"
    # `answer`: llguidance's JSON form (a JSON schema's) or Lark text (a tool call's)
    grammars = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [{"lark_grammar": answer}]
    grammars[0]["name"] = "answer"
    return json.dumps({"grammars": [{"lark_grammar": lark}] + grammars})
