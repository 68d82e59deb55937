"""Tool calling's pieces (runtime/tools.py): the request's tools checked, calls found in a reply
and in a stream, the convention written out for a template without tools, and the grammar of
one call, which random logits still follow to a call whose arguments validate."""

import json

import jsonschema
import numpy as np
import pytest

from qwc.models.tokenizer import THINK_TOKENS, byte_level_tokenizer, special_ids
from qwc.runtime.grammar import TokenVocab
from qwc.runtime.sampling import Sampler, SamplingParams
from qwc.runtime.tools import (
    CallStream,
    ToolError,
    call_grammar,
    fallback_messages,
    parse_tools,
    split_calls,
    template_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_parse_tools_and_choice():
    fns, choice = parse_tools([WEATHER, TIME], None)
    assert [f["name"] for f in fns] == ["get_weather", "get_time"] and choice is None
    assert parse_tools([WEATHER], "required")[1] == "required"
    assert parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})[1] == "get_weather"
    assert parse_tools(None, None) == ([], "none")
    for tools, choice, param, words in [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "letters, digits"),
        ([WEATHER, WEATHER], None, "tools", "twice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in 'tools'"),
        ([WEATHER], "sometimes", "tool_choice", "none, auto, required"),
        (None, "required", "tool_choice", "needs 'tools'"),
        ("tools", None, "tools", "a list"),
    ]:
        with pytest.raises(ToolError, match=words) as e:
            parse_tools(tools, choice)
        assert e.value.param == param


def test_calls_are_split_from_the_text():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = split_calls(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert split_calls("no calls here") == ("no calls here", [])
    assert split_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])


def test_a_stream_holds_back_what_may_be_a_call():
    s = CallStream()
    shown = [s.feed(p) for p in ["Sure", ". <tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}",
                                 "\n</tool_call>"]]
    assert "".join(shown) == "Sure. " and shown[1] == ". "
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    s = CallStream()
    assert "".join(s.feed(p) for p in ["a <to", "ol> b"]) == "a <tool> b" and s.finish() == ("", [])
    s = CallStream()
    assert s.feed("x <tool_") == "x " and s.finish() == ("<tool_", [])


def test_fallback_messages_write_the_convention():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    fns = parse_tools([WEATHER], None)[0]
    out = fallback_messages(msgs, fns)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
                                 '</tool_call>')
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert template_messages(msgs)[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    with pytest.raises(ToolError, match="not JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


@pytest.mark.parametrize("markers", [(), THINK_TOKENS], ids=["text markers", "<tool_call> a token (Qwen's)"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_random_logits_under_the_call_grammar_make_a_valid_call(choice, markers):
    tok = byte_level_tokenizer(markers)
    vocab = TokenVocab(tok, 300, set(special_ids(tok)[1]), tok.get_vocab_size())
    fns, named = parse_tools([WEATHER, TIME], choice if choice == "required" else
                             {"type": "function", "function": {"name": choice}})
    assert named == choice
    grammar = call_grammar(fns, None if choice == "required" else choice, vocab)
    vocab.check(grammar)
    for seed in range(3):
        c = vocab.constraint(grammar)
        s, rng, out = Sampler(SamplingParams(temperature=1.0, seed=seed), vocab.limit, c), np.random.default_rng(seed), []
        while not c.finished and len(out) < 400:
            out.append(s(rng.normal(size=300).astype(np.float32) * 4, out))
        content, calls = split_calls(tok.decode(out))
        assert c.finished and content is None and len(calls) == 1
        name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        assert name == choice or choice == "required"
        jsonschema.validate(args, next(f["parameters"] for f in fns if f["name"] == name))


def test_a_template_that_knows_tools_gets_them():
    """A template that renders tools itself (as Qwen2.5's does) gets `tools` and the calls'
    arguments as objects; one that does not gets the convention written out."""
    import types

    from qwc.runtime.server import Api, Settings

    knows = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
             "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}"
             "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}"
             "{% endfor %}")
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tok = byte_level_tokenizer()
    body = {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]}
    for template, want in [(knows, "[get_weather;]<user>Weather?<assistant>get_weather(Rome)<tool>rain"),
                           (plain, '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}')]:
        engine = types.SimpleNamespace(ctx=4096, vocab_size=300, eos={256}, sample_limit=259, tokenizer=tok,
                                       model=types.SimpleNamespace(chat_template=template),
                                       encode=lambda text: tok.encode(text).ids)
        reqs, opts = Api(engine, None, Settings("m")).parse(json.dumps(body).encode(), chat=True)
        assert want in tok.decode(reqs[0].prompt) and opts["tools"]
