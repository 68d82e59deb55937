"""`qwc serve --lora NAME=PATH`: adapters served unmerged beside the base, picked by each
request's `model`, driven by the `openai` client. Every model's greedy reply is the Engine's
with that adapter, concurrent requests over the base and two adapters included; /v1/models
lists them; an unknown name is OpenAI's 404; streaming, logprobs, json_schema and tools work
with an adapter as without."""

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from test_serve import CTX, WEATHER, Server

from qwc.compiler.compile import compile_file
from qwc.runtime.adapters import load_adapters
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams

from conftest import random_peft_adapter


def _peft(model, folder, r, seed):
    random_peft_adapter(model, folder, r=r, seed=seed)
    return folder


@pytest.fixture(scope="module")
def setup(tiny_q4, tiny_lm, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_lora")
    art = d / "tiny.qwc"
    compile_file(tiny_q4, "host", art, max_batch=4, max_lora_rank=16)
    ads = {"a": _peft(tiny_lm.model, d / "a", 8, 1), "b": _peft(tiny_lm.model, d / "b", 16, 2)}
    server = Server(art, "--max-batch", "4", "--lora", f"a={ads['a']}", "--lora", f"b={ads['b']}")
    yield art, ads, server
    server.close()


def _replies(art, ads, prompts_models, n):
    eng = Engine(art, ctx=CTX, threads=1)
    eng.load_adapters(load_adapters([(k, str(v)) for k, v in ads.items()], eng.model))
    return ["".join(eng.generate(p, max_new_tokens=n, sampling=SamplingParams(), adapter=None if m == "tiny" else m))
            for p, m in prompts_models]


def test_each_model_replies_as_the_engine_with_its_adapter(setup):
    art, ads, server = setup
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    jobs = [(f"Prompt number {i}: tell", ("tiny", "a", "b")[i % 3]) for i in range(6)]

    def ask(job):
        prompt, model = job
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert r.model == model
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:   # one batch mixes the base and both adapters
        got = list(pool.map(ask, jobs))
    want = _replies(art, ads, jobs, 8)
    assert got == want
    same = [(jobs[0][0], m) for m in ("tiny", "a", "b")]
    assert len(set(_replies(art, ads, same, 8))) == 3   # the adapters change the replies
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="c", prompt="x", max_tokens=2)


def test_streaming_logprobs_json_schema_and_tools_with_an_adapter(setup):
    _, _, server = setup
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    msgs = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="a", messages=msgs, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    stream = list(client.chat.completions.create(model="a", messages=msgs, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    assert all(c.model == "a" for c in stream)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    streamed = [e.token for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in whole.choices[0].logprobs.content]
    base = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True)
    assert base.choices[0].logprobs.content[0].logprob != whole.choices[0].logprobs.content[0].logprob

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="b", messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    r = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=400, temperature=1.0,
                                       seed=3).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1
    jsonschema.validate(json.loads(r.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
