"""Embeddings (runtime/embeddings.py, runtime/embedding_requests.py): the artifact's embed entry
points against transformers on the same float-linear weights (each pooling, an input longer than
one call), `qwc serve`'s /v1/embeddings through the `openai` client (float and base64, a list of
inputs batched through the scheduler equal to each alone), a Qwen3-Embedding-layout checkpoint
(the bare decoder's tensors) served unchanged, and bad requests answered with a clean 4xx."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from test_serve import Server

from qwc.cli import main
from qwc.runtime.engine import Engine

COSINE = 0.999   # the bound, float linears against transformers
RNG = np.random.default_rng(7)
INPUTS = [RNG.integers(0, 250, n).tolist() for n in (5, 300, 1, 17)]   # 300: over one call's 256


def _graph_table(model):
    """`model` (a transformers decoder) with its input embedding as the compiled graph holds it:
    `qwc optimize` keeps the linears in float here (--keep-float) but the table is Q4_0
    (passes/quantize_embedding.py), so the reference reads the same weights."""
    import copy

    from qwc.q4 import fake_quantize_q4_0

    model = copy.deepcopy(model)
    table = model.get_input_embeddings()
    table.weight = torch.nn.Parameter(torch.from_numpy(fake_quantize_q4_0(table.weight.detach().numpy())))
    return model


def _reference(model, inputs, pooling: str) -> np.ndarray:
    """transformers' final hidden states (after the last norm), pooled, L2-normalized."""
    model = _graph_table(model)
    out = []
    with torch.no_grad():
        for ids in inputs:
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
            v = {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[pooling]
            out.append(v / np.linalg.norm(v))
    return np.stack(out)


def _cosines(a, b) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def artifact(tiny_float, tmp_path_factory):
    out = tmp_path_factory.mktemp("embed") / "tiny.qwc"
    assert main(["-q", "compile", str(tiny_float), "--act-bits", "32", "--kv-dtype", "f32", "--max-batch", "4",
                 "--embeddings", "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_engine_embeddings_are_transformers(artifact, tiny_lm, pooling):
    eng = Engine(artifact, ctx=512, threads=1)
    got = eng.embed(INPUTS, pooling)
    assert got.shape == (len(INPUTS), tiny_lm.config.hidden_size) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)
    assert _cosines(got, _reference(tiny_lm.model, INPUTS, pooling)).min() >= COSINE


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, "--max-batch", "4", "--pooling", "mean")
    yield s
    s.close()


def test_the_openai_client_gets_float_and_base64_vectors_batched_as_alone(server, artifact):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    r = client.embeddings.create(model="tiny", input=INPUTS)
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(INPUTS)))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, INPUTS))
    alone = Engine(artifact, ctx=512, threads=1).embed(INPUTS, "mean")   # the server's --pooling
    assert np.abs(got - alone).max() < 1e-4
    raw = server.post("/v1/embeddings", {"model": "tiny", "input": INPUTS[:2], "encoding_format": "base64"}).json()
    b64 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]])
    assert np.abs(b64 - got[:2]).max() < 1e-4
    last = server.post("/v1/embeddings", {"input": INPUTS[0], "pooling": "last", "dimensions": 8}).json()["data"]
    want = Engine(artifact, ctx=512, threads=1).embed(INPUTS[:1], "last")[0][:8]
    assert np.abs(np.array(last[0]["embedding"]) - want / np.linalg.norm(want)).max() < 1e-4
    text = client.embeddings.create(model="tiny", input=["The capital of France is", "Paris"]).data
    assert len(text) == 2 and abs(np.linalg.norm(text[0].embedding) - 1) < 1e-5


def test_embeddings_run_beside_a_stream(server):
    """A request for embeddings while a long reply streams: it is answered before the stream
    ends (the scheduler interleaves their calls), and the stream goes on to its length."""
    import threading

    import httpx

    first, tokens = threading.Event(), []

    def stream():
        with httpx.stream("POST", server.base + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                                "stream": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    r = server.post("/v1/embeddings", {"input": INPUTS})
    assert r.status_code == 200 and len(r.json()["data"]) == len(INPUTS)
    assert t.is_alive()   # the stream had not ended
    t.join(120)
    assert len(tokens) >= 1500


@pytest.mark.parametrize("body, status, says", [
    ({"input": []}, 400, "'input' must be"),
    ({"input": ""}, 400, "empty string"),
    ({"input": [[]]}, 400, "input 0 must be"),
    ({"input": [[1, 2], [999999]]}, 400, "token id 999999"),
    ({"input": ["a"] * 10_000}, 400, "at most 2048"),
    ({"input": [[1] * 3000]}, 400, "3000 tokens"),
    ({"input": "hi", "encoding_format": "hex"}, 400, "'encoding_format'"),
    ({"input": "hi", "dimensions": 0}, 400, "'dimensions'"),
    ({"input": "hi", "pooling": "max"}, 400, "'pooling'"),
    ({"input": "hi", "model": "nope"}, 404, "does not exist"),
    ({"input": [1.5]}, 400, "input 0 must be"),
    (b"{not json", 400, ""),
])
def test_bad_embedding_requests_get_a_clean_error(server, body, status, says):
    r = server.post("/v1/embeddings", body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


def test_a_qwen3_embedding_layout_checkpoint_serves_unchanged(tmp_path):
    """Qwen3-Embedding's checkpoints are the bare decoder (Qwen3Model: no "model." prefix, no
    lm_head), read by last-token pooling: a random one of that layout, exported, optimized with
    float linears and compiled, against transformers' AutoModel on the same files."""
    from transformers import AutoModel

    from qwc.models.presets import load_preset

    lm = load_preset("tiny-qwen3")
    hf = tmp_path / "emb"
    lm.model.model.save_pretrained(hf)
    lm.tokenizer.save(str(hf / "tokenizer.json"))
    assert not any(k.startswith("model.") for k in lm.model.model.state_dict())
    assert main(["-q", "export", str(hf), "-o", str(tmp_path / "e.onnx")]) == 0
    assert main(["-q", "optimize", str(tmp_path / "e.onnx"), "--keep-float", "*", "-o", str(tmp_path / "f.onnx")]) == 0
    assert main(["-q", "compile", str(tmp_path / "f.onnx"), "--act-bits", "32", "--kv-dtype", "f32", "--embeddings",
                 "-o", str(tmp_path / "e.qwc")]) == 0
    got = Engine(tmp_path / "e.qwc", ctx=256, threads=1).embed(INPUTS[:1] + INPUTS[2:], "last")
    base = _graph_table(AutoModel.from_pretrained(hf).eval())
    with torch.no_grad():
        want = np.stack([base(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
                         for ids in INPUTS[:1] + INPUTS[2:]])
    assert _cosines(got, want).min() >= COSINE
