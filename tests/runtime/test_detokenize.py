"""runtime/detokenize.py: a reply's text a token at a time equals decoding the whole reply,
multi-byte characters held back until they complete, with a byte-level tokenizer (the tiny
model's) and a SentencePiece-style one."""

from __future__ import annotations

import random

import pytest

from qwc.runtime.detokenize import IncrementalText

TEXT = "Hello, wörld! 你好 🎉 naïve  spaces\tand\nlines — ünïcödé, 12345 ok."


def _tokenizers(tiny_host_artifact):
    """The tiny model's byte-level BPE, and a SentencePiece-style one (Metaspace: the decoder
    drops the text's leading space, so a window's first token decodes differently)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    return [Tokenizer.from_file(str(tiny_host_artifact / "tokenizer.json")), sp]


def test_pieces_add_up_to_the_whole_decode(tiny_host_artifact):
    for tok in _tokenizers(tiny_host_artifact):
        ids = tok.encode(TEXT).ids
        rng = random.Random(0)
        for seq in (ids, [rng.randrange(tok.get_vocab_size()) for _ in range(300)]):
            text = IncrementalText(tok)
            pieces = [text.add(i) for i in seq]
            whole = tok.decode(seq)
            assert "".join(pieces) == text.text
            assert whole.startswith(text.text) and (whole == text.text or whole.endswith("\ufffd"))
            for n in range(1, len(seq) + 1):   # never a partial character on the way
                assert "\ufffd" not in "".join(pieces[:n]) or "\ufffd" in tok.decode(seq[:n]).rstrip("\ufffd")


def test_without_a_tokenizer_there_is_no_text():
    text = IncrementalText(None)
    assert text.add(5) == "" and text.text == "" and text.ids == [5]


@pytest.mark.parametrize("chars", ["é", "你", "🎉"])
def test_a_character_split_over_byte_tokens_comes_whole(tiny_host_artifact, chars):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_host_artifact / "tokenizer.json"))
    ids = tok.encode("a" + chars + "b").ids
    text = IncrementalText(tok)
    pieces = [text.add(i) for i in ids]
    assert "".join(pieces) == "a" + chars + "b"
    assert all("\ufffd" not in p for p in pieces)
