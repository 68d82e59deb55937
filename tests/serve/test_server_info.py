"""`qwc serve`'s /tokenize, /detokenize, /props and /slots: llama-server's request shapes and
vLLM's, the token counts the tokenizer gives, round trips of the README's prompt and of a
multilingual text, llama-server's field names (a fixture of its response shapes), the slots
while a stream runs, bad input answered with a clean 400 naming the field, and the chat page
at / (its browser test: test_chat_page.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from test_serve import Server
from tokenizers import Tokenizer

SHAPES = json.loads((Path(__file__).resolve().parents[1] / "data" / "llama-server-shapes.json").read_text())
README_PROMPT = "The capital of France is"
MULTILINGUAL = ("Élodie a dit: « Ça va? » — 東京は日本の首都です。 Москва — столица России. "
                "مرحبا بالعالم 👋🏽 naïve café ß ﬁ 한국어 ") * 40


@pytest.fixture(scope="module")
def server(tiny_host_artifact):
    s = Server(tiny_host_artifact, "--max-batch", "2")
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_host_artifact):
    return Tokenizer.from_file(str(tiny_host_artifact / "tokenizer.json"))


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    assert len(MULTILINGUAL) >= 4000
    for text in (README_PROMPT, MULTILINGUAL):
        r = server.post("/tokenize", {"content": text})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids and r.json()["count"] == len(ids)
        back = server.post("/detokenize", {"tokens": ids}).json()
        assert back["content"] == text == back["prompt"]


def test_pieces_are_the_tokens_bytes(server):
    r = server.post("/tokenize", {"content": "naïve 東京", "with_pieces": True}).json()
    pieces = r["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw == "naïve 東京".encode()
    assert any(isinstance(p["piece"], list) for p in pieces)   # a byte-level piece of a character


def test_vllms_shapes(server, tokenizer):
    r = server.post("/tokenize", {"model": "tiny", "prompt": README_PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(README_PROMPT, add_special_tokens=True).ids
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = server.post("/tokenize", {"model": "tiny", "messages": msgs}).json()
    used = server.post("/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]
    assert server.post("/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()["prompt"] == README_PROMPT


def test_llama_server_field_names(server):
    props = server.base and httpx.get(server.base + "/props", timeout=30).json()
    assert set(SHAPES["props"]) <= set(props)
    assert set(SHAPES["default_generation_settings"]) <= set(props["default_generation_settings"])
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] == 2
    assert props["chat_template"] and props["model"] == "tiny"
    slots = httpx.get(server.base + "/slots", timeout=30).json()
    assert len(slots) == 2 and all(set(SHAPES["slot"]) <= set(s) for s in slots)
    assert all(set(SHAPES["next_token"]) <= set(s["next_token"]) for s in slots)
    assert set(SHAPES["tokenize"]) | set(SHAPES["vllm_tokenize"]) <= set(
        server.post("/tokenize", {"content": "x"}).json())
    assert set(SHAPES["detokenize"]) | set(SHAPES["vllm_detokenize"]) <= set(
        server.post("/detokenize", {"tokens": [1]}).json())


def test_slots_while_a_stream_runs(server):
    started = threading.Event()

    def stream():
        with httpx.stream("POST", server.base + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "Go", "max_tokens": 1500, "ignore_eos": True,
                                "stream": True, "temperature": 0.7, "seed": 5}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 20:
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    busy = [s for s in httpx.get(server.base + "/slots", timeout=30).json() if s["is_processing"]]
    t.join()
    assert len(busy) == 1
    s = busy[0]
    assert s["next_token"]["n_decoded"] > 0 and s["n_prompt_tokens"] >= 1
    assert s["params"]["temperature"] == pytest.approx(0.7) and s["params"]["seed"] == 5
    assert s["params"]["n_predict"] == 1500 and s["next_token"]["n_remain"] == 1500 - s["next_token"]["n_decoded"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", b"{not json", None),
    ("/tokenize", [1, 2], None),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "with_pieces": 1}, "with_pieces"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"content": "x" * ((1 << 24) + 1)}, "content"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", b"[", None),
])
def test_bad_requests_are_clean_400s(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_the_empty_and_the_padding_ids(server):
    assert server.post("/detokenize", {"tokens": []}).json()["content"] == ""
    assert server.post("/tokenize", {"content": ""}).json() == {"tokens": [], "count": 0, "max_model_len": 2048}
    # ids past the tokenizer but inside the model's padded vocabulary stand for no text
    assert server.post("/detokenize", {"tokens": [72, 287, 105]}).json()["content"] == "Hi"


def test_the_chat_page_is_one_file_that_fetches_nothing_from_elsewhere(server, tiny_host_artifact):
    r = httpx.get(server.base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "/v1/models" in r.text
    assert "http://" not in r.text and "https://" not in r.text and "//cdn" not in r.text
    without = Server(tiny_host_artifact, "--no-webui")
    try:
        r = httpx.get(without.base + "/")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /"
        assert httpx.get(without.base + "/v1/models").status_code == 200
    finally:
        without.close()
