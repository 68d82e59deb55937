"""A thinking model's replies (runtime/reasoning.py): the split of a whole reply and of the same
reply streamed in any pieces agree; the grammar that lets the model think before a constrained
answer; Qwen3's chat template's think blocks."""

import json

import jsonschema
import numpy as np
import pytest

from qwc.chat_template import ChatTemplate
from qwc.models.tokenizer import QWEN3_TEMPLATE, THINK_TOKENS, byte_level_tokenizer, special_ids
from qwc.runtime.grammar import TokenVocab
from qwc.runtime.reasoning import ReasoningStream, closes_thinking, opens_thinking, split_reasoning, thinking_grammar
from qwc.runtime.sampling import Sampler, SamplingParams

REPLIES = [
    ("<think>\nweighing it\nup\n</think>\n\nHello!", False, ("weighing it\nup", "Hello!")),
    ("plain answer, then <think>", False, (None, "plain answer, then <think>")),
    ("\nalready inside</think>\n\nok", True, ("already inside", "ok")),
    ("<think>\ncut by max_tokens\n", False, ("cut by max_tokens", "")),
    ("<th", False, (None, "<th")),
    ("\n\n<think>a</think>  b\n", False, ("a", "b\n")),
    ("<think></think>", False, ("", "")),
]


@pytest.mark.parametrize("text, inside, want", REPLIES)
def test_a_streamed_reply_splits_as_the_whole_one(text, inside, want):
    assert split_reasoning(text, inside) == want
    rng = np.random.default_rng(len(text))
    for _ in range(30):
        s, thought, answer, i = ReasoningStream(inside), "", "", 0
        while i < len(text):
            n = int(rng.integers(1, 5))
            t, a = s.feed(text[i:i + n])
            thought, answer, i = thought + t, answer + a, i + n
        t, a = s.finish()
        assert (thought + t, answer + a) == (want[0] or "", want[1])


def test_a_marker_split_across_pieces_is_held_back():
    s = ReasoningStream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\nfirst") == ("first", "")
    assert s.feed(" then\n</th") == (" then", "")      # the newline before </think> is the block's
    assert s.feed("ink>\n\nans") == ("", "ans")


def test_where_the_prompt_leaves_the_model():
    t = ChatTemplate(QWEN3_TEMPLATE)
    ask = [{"role": "user", "content": "Hi"}]
    on, off = t.render(ask), t.render(ask, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and not opens_thinking(on) and not closes_thinking(on)
    assert off == on + "<think>\n\n</think>\n\n" and closes_thinking(off)
    assert opens_thinking(on + "<think>\n")


def test_the_template_keeps_thinking_only_after_the_last_user_turn():
    t = ChatTemplate(QWEN3_TEMPLATE)
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "", "reasoning_content": "new",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "content": "42"}]
    text = t.render(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
    assert "old" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<think>\nnew\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>" in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def _vocab(tokens):
    tok = byte_level_tokenizer(tokens)
    return tok, TokenVocab(tok, 300, set(special_ids(tok)[1]), tok.get_vocab_size())


@pytest.mark.parametrize("tokens", [THINK_TOKENS, ()], ids=["markers are tokens", "markers are text"])
@pytest.mark.parametrize("inside", [False, True])
def test_the_grammar_takes_a_thought_then_the_answer(tokens, inside):
    tok, vocab = _vocab(tokens)
    grammar = thinking_grammar(vocab.json_grammar(SCHEMA), vocab, inside)
    vocab.check(grammar)
    for reply, ok in [("<think>\nit is {3}, <b>\n</think>\n\n{\"n\": 3}", True),
                      ("{\"n\": 3}", not inside),                        # no thinking: allowed unless inside a block
                      ("<think>\nhmm\n</think>\n\n{\"n\": 12}", False)]:  # the answer breaks the schema
        ids = tok.encode(reply.removeprefix("<think>") if inside else reply).ids
        c = vocab.constraint(grammar)
        took = all(c.allowed()[t] and (c.consume(t) or True) for t in ids)
        assert (took and c.finished) == ok, reply


def test_random_logits_think_then_answer_as_the_schema_says():
    """Markers that are tokens: the block opened and closed by bias, free text in it."""
    tok, vocab = _vocab(THINK_TOKENS)
    grammar = thinking_grammar(vocab.json_grammar(SCHEMA), vocab, False)
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    for seed in range(3):
        c = vocab.constraint(grammar)
        sampler, rng, out = Sampler(SamplingParams(temperature=1.0, seed=seed), vocab.limit, c), \
            np.random.default_rng(seed), []
        while not c.finished and len(out) < 400:
            logits = rng.normal(size=300).astype(np.float32) * 4
            logits[think] += 50
            logits[close] += 4
            out.append(sampler(logits, out))
        thought, answer = split_reasoning(tok.decode(out))
        assert c.finished and thought is not None and len(out) > 3
        jsonschema.validate(json.loads(answer), SCHEMA)
