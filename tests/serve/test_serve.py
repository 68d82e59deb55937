"""`qwc serve` end to end: a real server process on the tiny artifact, driven by the official
`openai` client and raw HTTP. Concurrent greedy requests equal single-stream greedy generation;
streams can be cancelled; every bad request gets OpenAI's error shape and status."""

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from qwc.compiler.compile import compile_file
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams
from qwc.runtime.scheduler import _safe_end

CTX = 2048
LONG = 2000   # tokens: a stream that lasts a second or more, to cancel or to hold a slot


@pytest.fixture(scope="module")
def artifact(tiny_q4, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "tiny.qwc"
    compile_file(tiny_q4, "host", out, max_batch=4)   # batched decode steps
    return out


class Server:
    def __init__(self, artifact, *extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "qwc", "serve", str(artifact), "--port", "0",
                                      "--ctx", str(CTX), "--threads", "1", *extra],
                                     stderr=subprocess.PIPE, text=True)
        said = ""
        for line in self.proc.stderr:   # notes, then the address
            said += line
            m = re.search(r"at (http://[^ ]+/v1)", line)
            if m or not line.startswith("[qwc] note:"):
                break
        if not m:
            self.proc.kill()
            raise AssertionError(f"server did not start: {said}{self.proc.stderr.read()}")
        self.url, self.notes = m[1], said
        self.base = self.url.removesuffix("/v1")

    def post(self, path, body, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.base + path, content=data, timeout=60, **kw)

    def metric(self, name) -> float:
        text = httpx.get(self.base + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, "--max-batch", "4")
    yield s
    s.close()


def _reference(artifact, prompts, n):
    eng = Engine(artifact, ctx=CTX, threads=1)
    out = []
    for p in prompts:
        eng.reset()
        out.append("".join(eng.generate(p, max_new_tokens=n, sampling=SamplingParams())))
    return out


@pytest.mark.slow
def test_concurrent_greedy_equals_single_stream(server, artifact):
    prompts = ["Hello there", "The cat sat on", "A long time ago in a galaxy", "x", "Numbers: 1 2 3", "Why?"]
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    results = [None] * len(prompts)

    def ask(i):
        r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0)
        results[i] = r

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = _reference(artifact, prompts, 12)
    for r, want in zip(results, ref):
        assert r.choices[0].text == want
        assert r.usage.completion_tokens <= 12 and r.choices[0].finish_reason in ("length", "stop")
    assert server.metric("qwc_decode_batch_size_bucket{le=\"1.0\"}") < server.metric("qwc_decode_batch_size_count")
    # prompts that arrived while others decoded carried their tokens (Scheduler: mixed steps)
    assert server.metric("qwc_mixed_steps") > 0


def test_streaming_chat_with_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert chunks[-1].usage.completion_tokens <= 6 and chunks[-1].usage.prompt_tokens > 1
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"


def test_sampling_with_a_seed_repeats(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    a, b = (client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=0.9, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_a_request_without_model_is_the_base_models(server):
    """`model` left out (llama-server and vLLM take that) is the served model, not a 404."""
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0}
    named = server.post("/v1/completions", {**body, "model": "tiny"})
    unnamed = server.post("/v1/completions", body)
    assert unnamed.status_code == 200, unnamed.text
    assert unnamed.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    assert unnamed.json()["model"] == "tiny"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    named, unnamed = server.post("/v1/chat/completions", {**chat, "model": "tiny"}), server.post("/v1/chat/completions", chat)
    assert unnamed.status_code == 200, unnamed.text
    assert unnamed.json()["choices"][0]["message"] == named.json()["choices"][0]["message"]


def test_penalties_and_logit_bias_are_the_engines(server, artifact):
    """presence_penalty, frequency_penalty and logit_bias reach the sampler as the Engine
    applies them (tests/runtime/test_sampling.py holds what they do), and a bias of 100 on
    one token makes every greedy token that one."""
    eng = Engine(artifact, ctx=CTX, threads=1)
    forced = eng.encode("z")[-1]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=1.5, logit_bias={forced: 2.5})
    want = "".join(eng.generate("Hello there", max_new_tokens=12, sampling=sp))
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 12, "temperature": 0,
            "presence_penalty": 0.5, "frequency_penalty": 1.5, "logit_bias": {str(forced): 2.5}}
    assert server.post("/v1/completions", body).json()["choices"][0]["text"] == want
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0,
            "logit_bias": {str(forced): 100}}
    assert server.post("/v1/completions", body).json()["choices"][0]["text"] == eng.tokenizer.decode([forced] * 4)


def test_logprobs_are_the_models_and_stream_as_they_whole(server, artifact):
    """Chat's logprobs/top_logprobs and the completions' legacy logprobs: the first token's
    are the prompt's logits through log-softmax (the same prefill), the chosen token is the
    likeliest under greedy sampling, and streaming gives the whole reply's entries."""
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    msgs = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 0
    # the tiny model's bytes are random: the text holds back a last partial character
    said = b"".join(bytes(c.bytes) for c in content).decode(errors="replace")
    assert said.startswith(whole.choices[0].message.content)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == c.top_logprobs[0].logprob <= 0 and c.token == bytes(c.bytes).decode(errors="replace")
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # (the same tokens; the values to rounding: the second request reuses the first's cache)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert np.allclose([e.logprob for e in streamed], [e.logprob for e in content], rtol=0, atol=1e-5)

    eng = Engine(artifact, ctx=CTX, threads=1)
    x = eng.prefill(eng.encode("Hello there"))[: eng.sample_limit].astype(np.float64)
    ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 3,
                                        "temperature": 0, "logprobs": 2}).json()["choices"][0]
    lp = r["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert abs(lp["token_logprobs"][0] - ref.max()) < 1e-6 and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert "".join(lp["tokens"]).startswith(r["text"].rstrip("\ufffd"))
    echo = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 3,
                                           "temperature": 0, "echo": True}).json()["choices"][0]
    assert echo["text"] == "Hello there" + r["text"] and echo["logprobs"] is None


def test_n_replies_share_the_prompt_and_each_is_a_single_requests(server):
    """n = 3: the replies copy the first one's prompt cache; reply i is what a request of its
    own with seed + i gives (the same prompt, cache and sampler), in the reply and streamed."""
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    kw = dict(model="tiny", prompt="Once upon", max_tokens=10, temperature=1.0, top_p=0.9)
    r = client.completions.create(**kw, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.completions.create(**kw, seed=5 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles and len(set(singles)) > 1
    assert r.usage.completion_tokens == sum(
        client.completions.create(**kw, seed=5 + i).usage.completion_tokens for i in range(3))
    streamed = ["", "", ""]
    for ch in client.completions.create(**kw, n=3, seed=5, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == singles
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of the next days",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


def test_tool_calls_forced_streamed_and_answered(server):
    """tool_choice required / named: even the random tiny model's reply is one call whose
    arguments validate (runtime/tools.py's grammar); the call streams as one tool_calls delta
    with the non-streamed reply's name and arguments; the tool's result is a valid next turn."""
    import jsonschema

    client = openai.OpenAI(base_url=server.url, api_key="unused")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=400, temperature=1.0, seed=3)
    r = client.chat.completions.create(**kw, tool_choice="required").choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**kw, tool_choice=named).choices[0].message.tool_calls[0]
    deltas = [c.choices[0] for c in client.chat.completions.create(**kw, tool_choice=named, stream=True)
              if c.choices]
    got = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert len(got) == 1 and got[0].index == 0 and deltas[-1].finish_reason == "tool_calls"
    assert (got[0].function.name, got[0].function.arguments) == (whole.function.name, whole.function.arguments)
    assert "".join(d.delta.content or "" for d in deltas) == ""
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    after = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls") and after.usage.prompt_tokens > 100


def test_a_gbnf_grammar_decides_the_reply(server):
    for seed in range(3):
        r = server.post("/v1/completions", {"model": "tiny", "prompt": "Answer:", "max_tokens": 8, "seed": seed,
                                            "grammar": 'root ::= "yes" | "no"'}).json()["choices"][0]
        assert r["text"] in ("yes", "no") and r["finish_reason"] == "stop"


def test_stop_strings_cut_the_text(server, artifact):
    full = _reference(artifact, ["Hello there"], 12)[0]
    assert len(full) > 4
    stop = full[2:4]
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 12,
                                        "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == full[:full.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    assert _safe_end("abc</s", ("</stop>",)) == 3 and _safe_end("abc", ("xyz",)) == 3


def test_a_repeated_prompt_reuses_its_cache(server, artifact):
    prompt = "A system prompt that every request of this test shares. " * 3
    before = server.metric("qwc_prompt_tokens_cached_total")
    first, again = (server.post("/v1/completions", {"model": "tiny", "prompt": prompt + tail, "max_tokens": 8,
                                                    "temperature": 0}).json() for tail in ("One", "Two"))
    n = again["usage"]["prompt_tokens"]
    assert n > 20 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 3
    assert again["choices"][0]["text"] == _reference(artifact, [prompt + "Two"], 8)[0]
    assert server.metric("qwc_prompt_tokens_cached_total") - before >= n - 3


def test_speculative_decoding_serves_the_same_text(artifact):
    """`--speculate ngram`: drafts from the context verified in one call each; the greedy text is
    the server's without drafts (tests/runtime/test_speculate.py checks the verification itself)."""
    # the random tiny model repeats few 3-grams of its own: any earlier token drafts here
    s = Server(artifact, "--max-batch", "2", "--speculate", "ngram", "--draft-max", "6", "--lookup-min", "1")
    try:
        assert "speculative decoding by prompt lookup, drafts of up to 6 tokens" in s.notes
        prompts = ["one two three four one two three four one two three four one two",
                   "The cat sat on the mat. The cat sat on the mat. The cat sat on"]
        for prompt in prompts:
            r = s.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 40,
                                           "temperature": 0}).json()
            assert r["choices"][0]["text"] == _reference(artifact, [prompt], 40)[0]
        assert s.metric("qwc_draft_tokens ") > 0
        assert 0 <= s.metric("qwc_draft_tokens_accepted ") <= s.metric("qwc_draft_tokens ")
    finally:
        s.close()


def test_a_draft_model_serves_the_same_text(artifact, tmp_path):
    """`--draft SMALL.qwc`: here the served artifact drafting for itself (the same tokenizer, the
    same greedy reply): the greedy text is the server's without drafts and most draft tokens
    are kept. A missing draft artifact, or a draft given with --speculate ngram, is refused in
    one line."""
    s = Server(artifact, "--max-batch", "2", "--draft", str(artifact), "--draft-max", "4")
    try:
        assert f"speculative decoding by a draft model ({artifact.name}), drafts of up to 4 tokens" in s.notes
        prompt = "The cat sat on the mat. The cat"
        r = s.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0}).json()
        assert r["choices"][0]["text"] == _reference(artifact, [prompt], 30)[0]
        assert s.metric("qwc_draft_tokens_accepted ") >= 0.5 * s.metric("qwc_draft_tokens ") > 0
    finally:
        s.close()
    for extra, words in ((["--draft", str(tmp_path / "none.qwc")], "--draft:"),
                         (["--draft", str(artifact), "--speculate", "ngram"], "give one")):
        r = subprocess.run([sys.executable, "-m", "qwc", "serve", str(artifact), "--port", "0", *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_cancelled_stream_frees_its_slot(server):
    before = server.metric('qwc_requests_total{outcome="cancelled"')
    with httpx.stream("POST", server.base + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Go", "max_tokens": LONG, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.time() + 20
    while time.time() < deadline and server.metric('qwc_requests_total{outcome="cancelled"') == before:
        time.sleep(0.1)
    assert server.metric('qwc_requests_total{outcome="cancelled"') == before + 1
    assert server.metric("qwc_running_sequences") == 0
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


# Bad requests and the OpenAI error each gets (test_qwen3_serve.py sends them to a Qwen3 artifact too)
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found", "does not exist"),
    ("/v1/completions", {"model": "tiny", "prompt": "a " * 1100}, 400, "context_length_exceeded", "context"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 5}, 400, None, "'temperature'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, None, "'top_p'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, None, "'max_tokens'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 17}, 400, None, "'n'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "best_of": 2}, 400, None, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "presence_penalty": 3}, 400, None, "'presence_penalty'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"x": 1}}, 400, None, "'logit_bias'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"5": 300}}, 400, None, "'logit_bias'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": [1]}, 400, None, "'stop'"),
    ("/v1/completions", {"model": "tiny", "prompt": [10 ** 9]}, 400, None, "token ids"),
    ("/v1/completions", {"model": "tiny"}, 400, None, "'prompt'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stream": "yes"}, 400, None, "'stream'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 50}, 400, None, "'logprobs'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 1, "echo": True}, 400, None, "'echo'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "response_format": {"type": "xml"}}, 400, None,
     "'response_format'"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, None, "schema"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "grammar": "root ::= ("}, 400, None, "GBNF"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "grammar": 'root ::= "a"', "ignore_eos": True}, 400, None,
     "'ignore_eos'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     400, None, "needs 'logprobs'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "echo": True},
     400, None, "'echo'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, None, "tool"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, None,
     "not in 'tools'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "tools": [WEATHER],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, None,
     "cannot be combined"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "tools": [WEATHER]}, 400, None, "'tools'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, None, "'messages'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "a"}]}, 400, None, "role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, None, "content"),
    ("/v1/nowhere", {}, 404, None, "no route"),
]


@pytest.mark.parametrize("path, body, status, code, words", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, code, words):
    r = server.post(path, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"]
    assert err["code"] == code
    # and the openai client raises its own error type for it
    if path == "/v1/completions" and isinstance(body, dict) and "model" in body and "prompt" in body and status == 400:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        # fields the client's completions.create does not take go as extra_body
        own = {k: v for k, v in body.items() if k in ("response_format", "grammar", "ignore_eos", "tools")}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{k: v for k, v in body.items() if k not in own}, extra_body=own or None)


def test_api_key_and_a_full_queue(artifact):
    s = Server(artifact, "--api-key", "sekrit", "--max-batch", "1", "--max-queue", "0")
    try:
        assert s.post("/v1/completions", {"model": "tiny", "prompt": "a"}).status_code == 401
        bad = openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url, api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list()] == ["tiny"]
        assert httpx.get(s.base + "/health").status_code == 200        # health needs no key
        auth = {"Authorization": "Bearer sekrit"}
        # one slot, no queue: of eight requests sent at once, those that find the slot busy get 503
        codes = []

        def ask():
            r = s.post("/v1/completions", {"model": "tiny", "prompt": "Go", "max_tokens": LONG, "ignore_eos": True},
                       headers=auth)
            codes.append((r.status_code, r.json().get("error", {}).get("code")))

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (200, None) in codes and (503, "server_overloaded") in codes, codes
        assert set(codes) <= {(200, None), (503, "server_overloaded")}
    finally:
        s.close()


def test_serve_refuses_a_busy_port_and_a_missing_artifact(artifact, tmp_path):
    s = Server(artifact)   # --max-batch 8 on an artifact of 4: a note first
    assert "batched decode of at most 4 sequences" in s.notes
    try:
        port = s.base.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "qwc", "serve", str(artifact), "--port", port],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot listen" in r.stderr
    finally:
        s.close()
    r = subprocess.run([sys.executable, "-m", "qwc", "serve", str(tmp_path / "none.qwc"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_a_streamed_event_is_one_line_whatever_the_text():
    """Unicode line separators JSON may hold raw (U+0085, U+2028, U+2029) are escaped in the
    events, so a client that splits the stream with str.splitlines (httpx's aiter_lines)
    reads each event whole; the text decodes to what it was."""
    from qwc.runtime.server import _sse

    text = "a\u2028b\x85c\u2029d é"
    event = _sse({"choices": [{"delta": {"content": text}}]})
    lines = event.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == text
