"""`qwc serve` on a Qwen3 artifact (tiny-qwen3: Qwen3's chat template with thinking, <think> and
<tool_call> as tokens of their own), driven by the official openai client: enable_thinking on
and off, reasoning_content apart in whole and streamed replies (or left in the text), a tool
call in Qwen3's format, a json_schema answer after free thinking.

The weights are random, so what a reply holds is steered with logit_bias: +100 on <think> makes
the reply open a block, a smaller bias on </think> ends it after a few tokens."""

import json

import jsonschema
import openai
import pytest
from test_serve import BAD_REQUESTS, Server  # the server process helper (tests/serve is not a package)

from qwc.cli import main

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Hi"}]
THINK = {"259": 100}                      # <think>: the reply opens a block (and, unconstrained, nothing else)
THINK_BRIEFLY = {"259": 100, "260": 8}    # ... and </think> soon closes it
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_serve")
    assert main(["-q", "export", "tiny-qwen3", "-o", str(d / "m.onnx")]) == 0
    assert main(["-q", "compile", str(d / "m.onnx"), "-o", str(d / "q3.qwc"), "--max-batch", "4"]) == 0
    s = Server(d / "q3.qwc", "--max-batch", "4")
    yield s
    s.close()


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused")


def _streamed(server, **kw):
    """(content, reasoning_content, tool calls, finish reason) of a streamed reply."""
    content, reasoning, calls, finish = "", "", [], None
    for ch in _client(server).chat.completions.create(model="q3", messages=ASK, stream=True, **kw):
        if ch.choices:
            d = ch.choices[0].delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            calls += d.tool_calls or []
            finish = ch.choices[0].finish_reason or finish
    return content, reasoning, calls, finish


def test_thinking_comes_back_apart_whole_and_streamed(server):
    kw = dict(max_tokens=5, temperature=0, logit_bias=THINK)
    m = _client(server).chat.completions.create(model="q3", messages=ASK, **kw).choices[0].message
    # the first <think> opens the block; the four after it are its text
    assert m.content == "" and m.reasoning_content == "<think>" * 4
    content, reasoning, _, finish = _streamed(server, **kw)
    assert (content, reasoning, finish) == ("", "<think>" * 4, "length")


def test_reasoning_format_none_leaves_it_in_the_text(server):
    kw = dict(max_tokens=5, temperature=0, logit_bias=THINK, extra_body={"reasoning_format": "none"})
    m = _client(server).chat.completions.create(model="q3", messages=ASK, **kw).choices[0].message
    assert m.content == "<think>" * 5 and getattr(m, "reasoning_content", None) is None
    assert _streamed(server, **kw)[:2] == ("<think>" * 5, "")


def test_enable_thinking_false_closes_the_block_in_the_prompt(server):
    """The prompt ends with an empty block (Qwen3's template), so the reply is all answer."""
    on = server.post("/tokenize", {"model": "q3", "messages": ASK}).json()["tokens"]
    off = server.post("/tokenize", {"model": "q3", "messages": ASK, **OFF}).json()["tokens"]
    assert off[:len(on)] == on and off[len(on):] == [259, 10, 10, 260, 10, 10]   # <think>\n\n</think>\n\n
    kw = dict(max_tokens=5, temperature=0, logit_bias=THINK, extra_body=OFF)
    m = _client(server).chat.completions.create(model="q3", messages=ASK, **kw).choices[0].message
    assert m.content == "<think>" * 5 and getattr(m, "reasoning_content", None) is None


@pytest.mark.parametrize("extra", [OFF, {}], ids=["thinking off", "thinking on"])
def test_a_tool_call_in_qwen3s_format(server, extra):
    kw = dict(max_tokens=300, temperature=0, tools=[TOOL], tool_choice="required", logit_bias=THINK_BRIEFLY,
              extra_body=extra)
    r = _client(server).chat.completions.create(model="q3", messages=ASK, **kw).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1 and not r.message.content
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
    content, _, calls, finish = _streamed(server, **kw)
    assert finish == "tool_calls" and [c.function.arguments for c in calls] == [call.arguments] and not content


def test_json_schema_constrains_the_answer_not_the_thinking(server):
    """The reply thinks (free text, whose tokens no JSON grammar would allow), then answers JSON
    that validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    r = _client(server).chat.completions.create(model="q3", messages=ASK, max_tokens=200, temperature=0,
                                                logit_bias={"259": 100, "260": 4}, response_format=fmt).choices[0]
    assert r.finish_reason == "stop" and r.message.reasoning_content
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    content, reasoning, _, _ = _streamed(server, max_tokens=200, temperature=0, logit_bias={"259": 100, "260": 4},
                                         response_format=fmt)
    assert (content, reasoning) == (r.message.content, r.message.reasoning_content)


def test_bad_reasoning_options_are_openai_errors(server):
    r = server.post("/v1/chat/completions", {"model": "q3", "messages": ASK, "reasoning_format": "loud"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
    r = server.post("/v1/chat/completions", {"model": "q3", "messages": ASK, "chat_template_kwargs": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("path, body, status, code, words", BAD_REQUESTS)
def test_the_bad_requests_qwen2_refuses_are_refused_alike(server, path, body, status, code, words):
    if isinstance(body, dict) and body.get("model") == "tiny":
        body = dict(body, model="q3")
    r = server.post(path, body)
    err = r.json()["error"]
    assert r.status_code == status and words in err["message"] and err["code"] == code


def test_a_qwen3_draft_model_changes_no_greedy_reply(server):
    """Speculation with a Qwen3 draft (here the model itself): the greedy reply is the server's
    without drafts. A prompt no earlier test sent: a reply depends on the cache it reuses (a
    reused position decoded before, in float32 products, where a fresh prompt's take float16
    operands), and on this random model a near tie then falls either way."""
    art = server.proc.args[4]
    with_draft = Server(art, "--max-batch", "2", "--draft", art, "--draft-max", "4")
    try:
        kw = dict(model="q3", messages=[{"role": "user", "content": "Draft a reply"}], max_tokens=24,
                  temperature=0, extra_body=OFF)
        want = _client(server).chat.completions.create(**kw).choices[0].message.content
        got = openai.OpenAI(base_url=with_draft.url, api_key="unused").chat.completions.create(**kw)
        assert got.choices[0].message.content == want and got.usage.completion_tokens == 24
    finally:
        with_draft.close()


def test_chat_template_kwargs_as_server_and_run_defaults(server, tmp_path):
    """`qwc serve --chat-template-kwargs` sets the template's variables under each request's own,
    as llama-server's flag does; `qwc run --chat` takes the same; bad JSON is one line."""
    import subprocess
    import sys

    art = server.proc.args[4]
    off = Server(art, "--chat-template-kwargs", '{"enable_thinking": false}')
    try:
        closed = off.post("/tokenize", {"model": "q3", "messages": ASK}).json()["tokens"]
        on = off.post("/tokenize", {"model": "q3", "messages": ASK,
                                    "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
        assert closed[len(on):] == [259, 10, 10, 260, 10, 10] and closed[:len(on)] == on
    finally:
        off.close()
    r = subprocess.run([sys.executable, "-m", "qwc", "-q", "run", art, "--chat", "--max-new-tokens", "4",
                        "--chat-template-kwargs", '{"enable_thinking": false}'],
                       input="hello\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.count("> ") == 2, r.stderr
    r = subprocess.run([sys.executable, "-m", "qwc", "run", art, "--chat", "--chat-template-kwargs", "{oops"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--chat-template-kwargs" in r.stderr and "Traceback" not in r.stderr
