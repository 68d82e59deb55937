"""Constrained sampling (runtime/grammar.py) and logprobs (runtime/sampling.py), on the tiny
byte-level tokenizer with random logits: whatever the logits say, the text follows the
grammar; bad schemas and grammars are refused in one line."""

import json

import jsonschema
import numpy as np
import pytest

from qwc.errors import QwcError
from qwc.models.tokenizer import byte_level_tokenizer, special_ids
from qwc.runtime.grammar import TokenVocab, response_format_grammar
from qwc.runtime.sampling import Sampler, SamplingParams, logprobs

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}
VOCAB = 320   # the tokenizer has 259 ids; the rest stand for a padded vocabulary's rows


@pytest.fixture(scope="module")
def vocab():
    tok = byte_level_tokenizer()
    return TokenVocab(tok, VOCAB, set(special_ids(tok)[1]), tok.get_vocab_size())


def _sample(vocab, grammar, seed, temperature=1.0, steps=300):
    c = vocab.constraint(grammar)
    s = Sampler(SamplingParams(temperature=temperature, seed=seed), vocab.limit, c)
    rng, out = np.random.default_rng(seed), []
    for _ in range(steps):
        out.append(s(rng.normal(size=VOCAB).astype(np.float32) * 4, out))
        if c.finished:
            return vocab.tokenizer.decode(out), True
    return vocab.tokenizer.decode(out), False


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_still_give_json_that_validates(vocab, seed):
    text, done = _sample(vocab, vocab.json_grammar(SCHEMA), seed)
    assert done, text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_greedy(vocab):
    """The likeliest token, "}", cannot come first; greedy takes it as soon as it may."""
    c = vocab.constraint(response_format_grammar({"type": "json_object"}, vocab))
    s = Sampler(SamplingParams(), vocab.limit, c)
    x = np.zeros(VOCAB, np.float32)
    x[ord("}")], x[ord("{")] = 5, 4
    out = [s(x, []), s(x, [])]
    assert vocab.tokenizer.decode(out) == "{}" and c.finished


def test_the_first_mask_allows_only_an_object_start(vocab):
    allowed = vocab.constraint(vocab.json_grammar(SCHEMA)).allowed()
    assert allowed.shape == (vocab.limit,)
    firsts = {vocab.tokenizer.decode([i]) for i in np.flatnonzero(allowed)}
    assert "{" in firsts and firsts <= {"{", " ", "\n", "\t", "\r"}


def test_gbnf_grammar(vocab):
    g = vocab.gbnf_grammar('root ::= "yes" | "no"')
    for seed in range(4):
        text, done = _sample(vocab, g, seed)
        assert done and text in ("yes", "no")


def test_a_finished_grammar_leaves_only_the_end_tokens(vocab):
    c = vocab.constraint(vocab.gbnf_grammar('root ::= "ok"'))
    for t in vocab.tokenizer.encode("ok").ids:
        assert c.allowed()[t]
        c.consume(t)
    assert c.finished and set(np.flatnonzero(c.allowed())) == set(vocab.eos)
    with pytest.raises(QwcError, match="not allowed"):
        vocab.constraint(vocab.gbnf_grammar('root ::= "ok"')).consume(vocab.tokenizer.encode("x").ids[0])


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "'type' is text, json_object or json_schema"),
    ("json", "'type' is text"),
    ({"type": "json_schema"}, "needs a 'json_schema' object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "cannot be used"),
])
def test_bad_response_formats_are_refused(vocab, fmt, words):
    with pytest.raises(QwcError, match=words):
        response_format_grammar(fmt, vocab)


def test_text_format_and_a_bad_gbnf(vocab):
    assert response_format_grammar({"type": "text"}, vocab) is None
    assert response_format_grammar(None, vocab) is None
    with pytest.raises(QwcError, match="GBNF"):
        vocab.gbnf_grammar("root ::= (")


def test_token_bytes_keep_partial_characters(vocab):
    assert vocab.token_bytes(0xC3) == b"\xc3" and vocab.token_bytes(ord("A")) == b"A"


def test_an_eos_id_past_the_tokenizer_still_gives_bytes_and_grammars():
    """A config of 262 ids whose eos_token_id is 259 beside a tokenizer of 259 tokens (ids
    259-261 have no text): token bytes and grammars work, and a finished grammar allows the
    model's own EOS, which llguidance was not handed."""
    tok = byte_level_tokenizer()
    v = TokenVocab(tok, 262, {259}, 262)
    assert v.token_bytes(ord("A")) == b"A" and v.token_bytes(0xC3) == b"\xc3"
    c = v.constraint(v.gbnf_grammar('root ::= "ok"'))
    for t in tok.encode("ok").ids:
        assert c.allowed()[t]
        c.consume(t)
    assert c.finished and set(np.flatnonzero(c.allowed())) == {259}


def test_logprobs_are_the_raw_distribution():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50).astype(np.float32) * 3
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    lp, top = logprobs(x, 7, 5)
    assert abs(lp - ref[7]) < 1e-12
    assert [i for i, _ in top] == list(np.argsort(-ref)[:5])
    assert all(abs(v - ref[i]) < 1e-12 for i, v in top)
    assert logprobs(x, 3, 0)[1] == []
    lp, top = logprobs(x, 3, 5, limit=40)   # ids past the tokenizer are not in the distribution
    assert all(i < 40 for i, _ in top) and lp > ref[3]
