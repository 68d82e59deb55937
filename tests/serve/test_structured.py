"""Structured output on real weights: `qwc serve` on SmolLM2 (`qwc data fetch`), driven by the
official openai client. Sampled at temperature 1, every json_schema reply validates against
its schema; json_object replies parse; streaming gives the non-streaming text; a required tool
call's arguments validate and the tool's result makes a second turn."""

import json

import jsonschema
import openai
import pytest
from test_serve import Server  # the server process helper (tests/serve is not a package)

from qwc.bench.structured import PERSON  # the schema its cost is measured with
from qwc.cli import main

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

ASK = [{"role": "user", "content": "Describe a person who lives in France, as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured")
    assert main(["-q", "export", "smollm2", "-o", str(d / "s.onnx")]) == 0
    assert main(["-q", "compile", str(d / "s.onnx"), "-o", str(d / "smol.qwc")]) == 0
    s = Server(d / "smol.qwc", "--max-batch", "8")
    yield s
    s.close()


def test_json_schema_replies_validate_20_of_20(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(8) as pool:   # eight at a time: the batched decode steps
        replies = list(pool.map(lambda seed: client.chat.completions.create(
            model="smol", messages=ASK, temperature=1.0, seed=seed, max_tokens=200, response_format=fmt),
            range(20)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_streaming(server):
    """Any JSON object (a 135M model loops at greedy when asked for free-form JSON in a chat, so
    the prompt is few-shot, whose reply ends)."""
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    prompt = ('Country: Italy\nJSON: {"capital": "Rome", "language": "Italian"}\n'
              'Country: Spain\nJSON: {"capital": "Madrid", "language": "Spanish"}\nCountry: France\nJSON: ')
    kw = dict(model="smol", prompt=prompt, temperature=0, max_tokens=100,
              extra_body={"response_format": {"type": "json_object"}})
    whole = client.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.text), dict)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == whole.text


def test_the_same_reply_from_qwc_run(server, tmp_path, capsys):
    """`qwc run --json-schema` and the server agree at temperature 0 (the same sampler and mask)."""
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.completions.create(model="smol", prompt="A person, as JSON: ", temperature=0, max_tokens=200,
                                  extra_body={"response_format": fmt})
    art = server.proc.args[4]
    capsys.readouterr()
    assert main(["-q", "run", art, "--prompt", "A person, as JSON: ", "--max-new-tokens", "200",
                 "--json-schema", json.dumps(PERSON)]) == 0
    out = capsys.readouterr().out
    assert out == "A person, as JSON: " + r.choices[0].text + "\n"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_a_required_tool_call_and_the_turn_after_it(server):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}}
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(5):
        r = client.chat.completions.create(model="smol", messages=msgs, tools=[tool], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=100).choices[0]
        assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1
        jsonschema.validate(json.loads(r.message.tool_calls[0].function.arguments),
                            tool["function"]["parameters"])
    call = r.message.tool_calls[0]
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    after = client.chat.completions.create(model="smol", messages=msgs, tools=[tool], temperature=0, max_tokens=40)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.choices[0].message.content or after.choices[0].message.tool_calls
