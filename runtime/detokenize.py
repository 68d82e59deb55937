"""Generated token ids to text, one token at a time, without decoding the whole reply again at
every token (which is O(n^2) in the reply's length).

The text of the newest tokens is what decoding a short window that ends with them adds to
decoding the same window without them (the window starts a few tokens back, so decoders that
treat a text's first token specially, SentencePiece's leading space, see the same start both
times). A piece that ends inside a UTF-8 sequence (a byte token of a multi-byte character) is
held back until the character completes, as decoding the whole reply would show it."""

from __future__ import annotations

PARTIAL = "\ufffd"   # what a tokenizer's decode gives for an incomplete UTF-8 sequence


class IncrementalText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""        # the reply's text so far, complete characters only
        self._start = 0       # the window: ids[_start:] is decoded each time ...
        self._read = 0        # ... and ids[_start:_read] is what self.text already holds of it

    def add(self, tok: int) -> str:
        """Take one generated token; the text it completes (maybe "")."""
        self.ids.append(tok)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.ids[self._start:self._read])
        now = self.tokenizer.decode(self.ids[self._start:])
        if len(now) <= len(before) or now.endswith(PARTIAL):
            return ""
        piece = now[len(before):]
        self.text += piece
        self._start, self._read = self._read, len(self.ids)
        return piece
