"""YaRN, Qwen2.5's long-context rope scaling: the tables against transformers', the config
read from an HF directory and a GGUF, and a tiny YaRN model through export, compile and the
engine against transformers and onnxruntime past its original context."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.errors import QwcError
from qwc.models.qwen2 import build_model, hf_config
from qwc.rotary import model_rotary_caches

from conftest import greedy_against_onnxruntime, ort_kv_logits, torch_kv_logits

QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}   # Qwen2.5's model card


def _hf_tables(hf: Qwen2Config, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cos, sin = Qwen2RotaryEmbedding(hf)(torch.zeros(1), torch.from_numpy(positions)[None])
    half = hf.head_dim // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


@pytest.mark.parametrize("head_dim, theta, rope", [
    (128, 1e6, QWEN25_YARN),
    (64, 1e6, {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 4096, "beta_fast": 16}),
    (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3,
               "truncate": False}),
])
def test_yarn_tables_are_transformers(head_dim, theta, rope):
    d = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": head_dim * 2, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim,
         "rope_theta": theta, "max_position_embeddings": rope["original_max_position_embeddings"], "rope_scaling": rope}
    cfg = ModelConfig.from_hf_dict(d, "y", "config.json")
    assert cfg.context_length == int(rope["factor"] * rope["original_max_position_embeddings"])
    hf = hf_config(dataclasses.replace(cfg))
    assert hf.rope_parameters["rope_type"] == "yarn"
    cos, sin = model_rotary_caches(dataclasses.replace(cfg, max_position_embeddings=1))   # yarn: still every position
    assert cos.shape == (cfg.context_length, head_dim // 2)
    at = np.unique(np.linspace(0, cfg.context_length - 1, 200).astype(np.int64))
    want_cos, want_sin = _hf_tables(hf, at)
    np.testing.assert_allclose(cos[at], want_cos, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want_cos).max())))
    np.testing.assert_allclose(sin[at], want_sin, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want_sin).max())))
    if "attention_factor" in rope:   # the factor on cos and sin is there, not 1
        assert np.abs(cos[0]).max() == pytest.approx(rope["attention_factor"], rel=1e-6)


@pytest.mark.parametrize("rope, expect", [
    ({"type": "linear", "factor": 2.0}, "unsupported rope scaling 'linear'"),
    ({"type": "yarn", "original_max_position_embeddings": 64}, "YaRN rope scaling lacks factor"),
    ({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}, "factor 0.5 must be at least 1"),
    ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64.5}, "must be a positive integer"),
    ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "low_freq_factor": 1}, "low_freq_factor"),
])
def test_rope_scaling_that_is_not_yarn_or_is_malformed_is_refused(rope, expect):
    d = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "rope_scaling": rope}
    with pytest.raises(QwcError, match=expect):
        ModelConfig.from_hf_dict(d, "y", "config.json")


@pytest.fixture(scope="module")
def yarn_hf_dir(tiny_lm, tmp_path_factory):
    """The tiny model with YaRN over an original context of 32 (factor 4: 128 positions), saved
    as a hub-style HF directory."""
    cfg = dataclasses.replace(tiny_lm.config, max_position_embeddings=32,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(1)
    model = build_model(cfg, initializer_range=0.2)
    src = tmp_path_factory.mktemp("yarn") / "hf"
    model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    assert json.loads((src / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    return src, model


@pytest.mark.slow
def test_a_yarn_model_exports_compiles_and_runs_past_its_original_context(yarn_hf_dir, tmp_path, capsys):
    """Export from the HF directory: onnxruntime on the graph gives transformers' logits over a
    100-token prompt (past the original 32 positions) and two steps; compiled for the host,
    the engine gives onnxruntime's on the int4 graph; a context past 128 is refused in one line."""
    from qwc.passes.verify import run_steps, session
    from qwc.runtime.engine import Engine

    src, model = yarn_hf_dir
    onnx_path, q4, art = tmp_path / "y.onnx", tmp_path / "y.q4.onnx", tmp_path / "y.qwc"
    assert main(["-q", "export", str(src), "-o", str(onnx_path)]) == 0
    cfg = ModelConfig.load(sidecar_paths(onnx_path)[0])
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.context_length == 128
    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, cfg.vocab_size, (1, 100)), [rng.integers(0, cfg.vocab_size, (1, 1)) for _ in range(2)]
    want = torch_kv_logits(model, prompt, steps)
    for got, ref in zip(ort_kv_logits(onnx_path, cfg, prompt, steps), want):
        assert np.abs(got[0, -1] - ref[0, -1]).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    # the streamed export (what checkpoints of 1B parameters and more take) writes the same tables
    assert main(["-q", "export", str(src), "-o", str(tmp_path / "s.onnx"), "--exporter", "stream"]) == 0
    streamed = run_steps(session(str(tmp_path / "s.onnx")), cfg, [prompt] + steps, ctx=128)   # a static cache
    for got, ref in zip(streamed, want):
        assert np.abs(got[0, -1] - ref[0, -1]).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert main(["-q", "optimize", str(onnx_path), "-o", str(q4)]) == 0
    assert main(["-q", "compile", str(q4), "--target", "host", "--act-bits", "32", "--kv-dtype", "f32",
                 "-o", str(art)]) == 0
    greedy_against_onnxruntime(art, q4, cfg, prompt, n_steps=3, ctx=128)
    with pytest.raises(QwcError, match="ctx 129 exceeds the model's 128 positions"):
        Engine(art, ctx=129)


def test_a_yarn_gguf_keeps_its_scaling(tiny_lm, tmp_path):
    """llama.cpp's rope scaling keys: written from a YaRN config and read back as the same
    YaRN; another scaling type is refused."""
    from gguf import GGUFReader

    from qwc.models.gguf_loader import config_from_gguf
    from qwc.models.gguf_writer import write_gguf

    cfg = dataclasses.replace(tiny_lm.config, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 32})
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    path = write_gguf(tmp_path / "y.gguf", "qwen2", cfg, tokens, [1] * len(tokens), {})
    back, _ = config_from_gguf(GGUFReader(str(path)), path)
    assert back.rope_scaling == cfg.rope_scaling
