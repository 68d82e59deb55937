"""A model whose config names an EOS id its tokenizer lacks (vocab 288, a tokenizer of 259
tokens, eos_token_id 259): requests with logprobs, and constrained ones, answer 200 as the
others do, where llguidance's tokenizer once raised inside the handler (a 500)."""

from __future__ import annotations

from test_serve import Server

from conftest import copy_artifact, edit_manifest


def test_logprobs_and_json_on_an_eos_past_the_tokenizer(tiny_host_artifact, tmp_path):
    art = copy_artifact(tiny_host_artifact, tmp_path)
    edit_manifest(art, lambda m: m["model"].update(eos_token_ids=[259]))
    s = Server(art)
    try:
        ask = {"model": "copy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = s.post("/v1/chat/completions", {**ask, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["content"]) >= 1
        r = s.post("/v1/chat/completions", {**ask, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert s.post("/v1/chat/completions", ask).status_code == 200
    finally:
        s.close()
