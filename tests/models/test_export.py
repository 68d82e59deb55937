"""`qwc export` of the tiny preset: onnxruntime on the graph against transformers in torch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from tokenizers import Tokenizer

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths

from conftest import ort_kv_logits, torch_kv_logits


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_then_decode_matches_torch(tiny_lm, tiny_onnx, batch):
    rng = np.random.default_rng(batch)
    vocab = tiny_lm.config.vocab_size
    prompt = rng.integers(0, vocab, (batch, 8))
    steps = [rng.integers(0, vocab, (batch, 1)) for _ in range(4)]
    ref = torch_kv_logits(tiny_lm.model, prompt, steps)
    got = ort_kv_logits(tiny_onnx, tiny_lm.config, prompt, steps)
    assert [g.shape for g in got] == [(batch, 8, vocab)] + [(batch, 1, vocab)] * 4
    for r, g in zip(ref, got):
        assert np.abs(r - g).max() < 1e-4
    # The logits are not flat: greedy decoding on this model is a meaningful check.
    top2 = np.sort(ref[0][0, -1])[-2:]
    assert top2[1] - top2[0] > 1e-3


def test_graph_signature_is_the_kv_cache_contract(tiny_onnx, tiny_lm):
    g = onnx.load(str(tiny_onnx), load_external_data=False).graph
    n = tiny_lm.config.num_hidden_layers
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(g.input) + list(g.output)}
    kvh, hd = tiny_lm.config.num_key_value_heads, tiny_lm.config.head_dim
    assert [i.name for i in g.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert [o.name for o in g.output] == ["logits"] + [
        f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert dims["input_ids"] == ["batch", "seq"]
    assert dims["attention_mask"] == ["batch", "total"]
    assert dims["past_key_values.0.key"] == ["batch", kvh, "past", hd]
    assert dims["logits"][0] == "batch" and dims["logits"][2] == tiny_lm.config.vocab_size
    assert isinstance(dims["present.0.value"][2], str)  # dynamic past + seq


def test_sidecars_let_later_stages_work_without_torch(tiny_onnx, tiny_lm):
    cfg_path, tok_path = sidecar_paths(tiny_onnx)
    cfg = ModelConfig.load(cfg_path)
    assert cfg == tiny_lm.config
    tok = Tokenizer.from_file(str(tok_path))
    text = "Hello, wörld! <|im_end|>"
    ids = tok.encode(text).ids
    assert ids[-1] in cfg.eos_token_ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert "<|im_start|>" in cfg.chat_template


@pytest.mark.slow
def test_cli_export_writes_all_files(tmp_path, capsys):
    out = tmp_path / "sub" / "m.onnx"
    assert main(["export", "tiny", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.config.json", "m.onnx", "m.tokenizer.json"]
    assert json.loads((tmp_path / "sub" / "m.config.json").read_text())["name"] == "tiny"
    assert "exported tiny" in capsys.readouterr().err
