"""Qwen3's dense models: their config and tensors, both exporters against transformers, a
`qwen3` GGUF, and the compiled host artifact's greedy tokens against transformers on the same
weights (issue 87's exactness)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.errors import QwcError
from qwc.models.checkpoint import expected_tensors
from qwc.models.presets import PRESET_NAMES, preset_checkpoint, preset_config

from conftest import ort_kv_logits, random_peft_adapter, torch_kv_logits

# The published config.json files' shapes (Qwen/Qwen3-*): hidden, layers, heads, kv heads, ffn, tied
PUBLISHED = {"qwen3-0.6b": (1024, 28, 16, 8, 3072, True), "qwen3-1.7b": (2048, 28, 16, 8, 6144, True),
             "qwen3-4b": (2560, 36, 32, 8, 9728, True), "qwen3-8b": (4096, 36, 32, 8, 12288, False),
             "qwen3-14b": (5120, 40, 40, 8, 17408, False), "qwen3-32b": (5120, 64, 64, 8, 25600, False)}
STEPS = [np.array([[5]]), np.array([[6]]), np.array([[7]])]
PROMPT = np.array([[72, 101, 108, 108, 111, 44, 32, 119]])


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_shapes(name):
    h, layers, heads, kv, ffn, tied = PUBLISHED[name]
    cfg = preset_config(name)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.tie_word_embeddings) == PUBLISHED[name]
    assert cfg.head_dim == 128 and cfg.vocab_size == 151936 and cfg.qk_norm and not cfg.attention_bias
    t = expected_tensors(cfg)
    # head_dim is its own field: q_proj is hidden -> heads x 128, not hidden -> hidden
    assert t["model.layers.0.self_attn.q_proj.weight"] == (heads * 128, h)
    assert t["model.layers.0.self_attn.o_proj.weight"] == (h, heads * 128)
    assert t["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert not any(k.endswith("_proj.bias") for k in t)
    assert f"{name}-2layers" not in PRESET_NAMES or preset_config(f"{name}-2layers").num_hidden_layers == 2


@pytest.mark.parametrize("name,hidden,layers,heads,kv,ffn,params", [
    ("qwen2.5-7b", 3584, 28, 28, 4, 18944, 7.62e9), ("qwen2.5-14b", 5120, 48, 40, 8, 13824, 14.77e9),
    ("qwen2.5-32b", 5120, 64, 40, 8, 27648, 32.76e9)])
def test_qwen25_checkpoint_presets_have_the_published_shapes(name, hidden, layers, heads, kv, ffn, params):
    # the published config.json's: heads of 128, vocab 152064, untied, q/k/v biases
    cfg = preset_config(name)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == ("qwen2", hidden, layers, ffn)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (heads, kv, 152064, False)
    t = expected_tensors(cfg)
    assert t["model.layers.0.self_attn.k_proj.bias"] == (kv * 128,) and t["lm_head.weight"] == (152064, hidden)
    assert sum(int(np.prod(s)) for s in t.values()) == pytest.approx(params, rel=1e-3)
    assert preset_checkpoint(name).tensor("model.layers.0.self_attn.k_proj.bias").shape == (kv * 128,)


def test_a_qwen3_config_json_reads_as_qwen3():
    raw = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
           "rope_theta": 1000000, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
           "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645}
    cfg = ModelConfig.from_hf_dict(raw, name="q", source="config.json")
    assert cfg.architecture == "qwen3" and cfg.head_dim == 128
    assert ModelConfig.from_dict(json.loads(cfg.to_json())).architecture == "qwen3"
    with pytest.raises(QwcError, match="attention_bias true is not supported for qwen3"):
        ModelConfig.from_hf_dict(dict(raw, attention_bias=True), name="q", source="config.json")
    with pytest.raises(QwcError, match="unsupported architecture 'qwen3_moe'"):
        ModelConfig.from_hf_dict(dict(raw, model_type="qwen3_moe"), name="q", source="config.json")


def test_a_preset_checkpoint_is_the_same_in_every_read():
    a, b = preset_checkpoint("tiny-qwen3"), preset_checkpoint("tiny-qwen3")
    name = "model.layers.1.self_attn.k_norm.weight"
    assert np.array_equal(a.tensor(name), b.tensor(name))
    assert not np.array_equal(a.tensor(name), a.tensor("model.layers.0.self_attn.k_norm.weight"))
    assert 0.5 <= a.tensor(name).min() and a.tensor(name).max() <= 1.5


@pytest.fixture(scope="module")
def qwen3_lm():
    from qwc.models.presets import load_preset

    return load_preset("tiny-qwen3")


@pytest.fixture(scope="module")
def qwen3_dir(qwen3_lm, tmp_path_factory):
    """tiny-qwen3 as a Hugging Face directory (transformers' save_pretrained)."""
    d = tmp_path_factory.mktemp("qwen3") / "hf"
    qwen3_lm.model.save_pretrained(d)
    qwen3_lm.tokenizer.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("exporter", ["torch", "stream"])
def test_both_exporters_match_transformers(qwen3_lm, qwen3_dir, tmp_path, exporter):
    out = tmp_path / f"{exporter}.onnx"
    assert main(["-q", "export", str(qwen3_dir), "-o", str(out), "--exporter", exporter]) == 0
    cfg = ModelConfig.load(sidecar_paths(out)[0])
    assert cfg.architecture == "qwen3"
    ref = torch_kv_logits(qwen3_lm.model, PROMPT, STEPS)
    for got, want in zip(ort_kv_logits(out, cfg, PROMPT, STEPS), ref):
        assert _rel(got, want) < 1e-4
    # the passes make the same canonical graph of both: QK-norm as a per-head norm before rotary
    assert main(["-q", "optimize", str(out), "-o", str(tmp_path / "q4.onnx")]) == 0
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q4.onnx"), load_external_data=False).graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 1 + 2 * cfg.num_hidden_layers   # first norm, q and k
    assert ops.count("RotaryEmbedding") == 2 * cfg.num_hidden_layers and "Softmax" not in ops


def test_a_peft_adapter_merges_as_peft_merges_it(qwen3_lm, tmp_path):
    """PEFT's target names for Qwen3 are Qwen2's; the merged export against peft's own model."""
    pm = random_peft_adapter(qwen3_lm.model, tmp_path / "lora")
    assert main(["-q", "export", "tiny-qwen3", "--lora", str(tmp_path / "lora"), "-o", str(tmp_path / "m.onnx")]) == 0
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "m.onnx")[0])
    ref = torch_kv_logits(pm.merge_and_unload(), PROMPT, STEPS)
    for got, want in zip(ort_kv_logits(tmp_path / "m.onnx", cfg, PROMPT, STEPS), ref):
        assert _rel(got, want) < 1e-4


def test_awq_and_gptq_take_a_qwen3_graph(tmp_path, calib_text):
    """The calibrated passes run on the per-head norms' graph and quantize every linear."""
    assert main(["-q", "export", "tiny-qwen3", "-o", str(tmp_path / "m.onnx")]) == 0
    assert main(["-q", "optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--awq", "--gptq",
                 "--calib", str(calib_text), "--calib-tokens", "1024"]) == 0
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 7 * 2 + 1 and "MatMul" not in ops


def _qwen3_gguf(path, ckpt, names=None) -> None:
    """A qwen3 GGUF of `ckpt`'s tensors `names` (default: all): the embedding Q8_0, every linear
    F32 (float linears, as issue 87's exactness has them), norms F32."""
    from gguf import TokenType

    from qwc.models.gguf_writer import write_gguf
    from qwc.models.tokenizer import SPECIAL_TOKENS

    cfg = ckpt.config
    tensors = {}
    for name in expected_tensors(cfg) if names is None else names:
        a = ckpt.tensor(name)
        tensors[name] = (quantize(a, Q.Q8_0), Q.Q8_0) if name == "model.embed_tokens.weight" else (a, None)
    vocab = [t for t, _ in sorted(ckpt.tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    vocab += [f"[PAD{i}]" for i in range(cfg.vocab_size - len(vocab))]
    types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in vocab]
    write_gguf(path, "qwen3", cfg, vocab, types, tensors)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_gguf")
    _qwen3_gguf(d / "m.gguf", preset_checkpoint("tiny-qwen3"))
    return d / "m.gguf"


def test_a_qwen3_gguf_exports_with_its_head_norms(qwen3_gguf, tmp_path):
    from qwc.models.gguf_loader import load_gguf, open_gguf

    ckpt = open_gguf(qwen3_gguf)
    assert ckpt.config.architecture == "qwen3" and ckpt.config.head_dim == 64
    assert np.array_equal(ckpt.tensor("model.layers.1.self_attn.q_norm.weight"),
                          preset_checkpoint("tiny-qwen3").tensor("model.layers.1.self_attn.q_norm.weight"))
    assert main(["-q", "export", str(qwen3_gguf), "-o", str(tmp_path / "m.onnx")]) == 0
    ref = torch_kv_logits(load_gguf(qwen3_gguf).model, PROMPT, STEPS)   # the file's weights, dequantized
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "m.onnx")[0])
    for got, want in zip(ort_kv_logits(tmp_path / "m.onnx", cfg, PROMPT, STEPS), ref):
        assert _rel(got, want) < 1e-4


def test_a_gguf_lacking_a_head_norm_is_refused_naming_it(tmp_path, capsys):
    ckpt = preset_checkpoint("tiny-qwen3")
    held = [k for k in expected_tensors(ckpt.config) if k != "model.layers.1.self_attn.k_norm.weight"]
    _qwen3_gguf(tmp_path / "cut.gguf", ckpt, held)
    assert main(["export", str(tmp_path / "cut.gguf"), "-o", str(tmp_path / "m.onnx")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks model.layers.1.self_attn.k_norm.weight" in err[0]
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_transformers(qwen3_gguf, tmp_path):
    """Float linears, the file's Q8_0 embedding, float activations: the host artifact's 16
    greedy tokens are transformers' on the file's (dequantized) weights."""
    import torch

    from qwc.models.gguf_loader import load_gguf
    from qwc.runtime.engine import Engine

    assert main(["-q", "export", str(qwen3_gguf), "-o", str(tmp_path / "m.onnx")]) == 0
    assert main(["-q", "optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "f.onnx"), "--keep-float", "*",
                 "--lm-head-bits", "8"]) == 0
    assert main(["-q", "compile", str(tmp_path / "f.onnx"), "-o", str(tmp_path / "m.qwc"), "--act-bits", "32",
                 "--kv-dtype", "f32"]) == 0
    model = load_gguf(qwen3_gguf).model
    ids = PROMPT[0].tolist()
    want = list(ids)   # transformers' greedy tokens, end of text included (generate would suppress it)
    with torch.no_grad():
        for _ in range(16):
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    eng = Engine(tmp_path / "m.qwc", ctx=64)
    logits, got = eng.prefill(ids), []
    for _ in range(16):
        got.append(int(logits.argmax()))
        logits = eng.decode(got[-1])
    assert got == want[len(ids):]


@pytest.fixture(scope="module")
def qwen3_artifacts(tmp_path_factory):
    """tiny-qwen3 exported, quantized, and compiled twice for the host as `qwc compile` builds
    by default (with batched decode): with QK-norm fused into the rotary and decode attention
    kernels, and without (the norm as imported, kernels/head_norm.py's reference)."""
    from qwc.compiler.compile import compile_file
    from qwc.compiler.frontend import RotaryEmbedding

    d = tmp_path_factory.mktemp("qwen3_art")
    assert main(["-q", "export", "tiny-qwen3", "-o", str(d / "m.onnx")]) == 0
    assert main(["-q", "optimize", str(d / "m.onnx"), "-o", str(d / "q4.onnx")]) == 0
    compile_file(d / "q4.onnx", "host", d / "fused.qwc", max_batch=4)
    unfused = pytest.MonkeyPatch()
    unfused.setattr(RotaryEmbedding, "_head_norm", staticmethod(lambda bb, x, heads: None))
    try:
        compile_file(d / "q4.onnx", "host", d / "plain.qwc", max_batch=4)
    finally:
        unfused.undo()
    return d


def _kernels(art) -> str:
    import subprocess

    return subprocess.run(["nm", "-D", str(art / "lib.so")], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_qk_norm_fuses_into_rotary_and_decode_attention_without_changing_a_bit(qwen3_artifacts):
    from qwc.runtime.engine import Engine

    fused, plain = qwen3_artifacts / "fused.qwc", qwen3_artifacts / "plain.qwc"
    names = _kernels(fused)
    assert "decode_attention_3pass_q8_float16_head_norm" in names   # one decode kernel: norm, rotary, cache, attention
    assert "prefill_rotary_head_norm" in names and "rms_norm" not in names.replace("act_q8_rms", "")
    assert "decode_attention_3pass_q8_float16_head_norm" not in _kernels(plain)
    a, b = Engine(fused, ctx=64), Engine(plain, ctx=64)
    ids = PROMPT[0].tolist()
    np.testing.assert_array_equal(a.prefill(ids), b.prefill(ids))
    for t in (5, 6, 7, 100, 250):
        np.testing.assert_array_equal(a.decode(t), b.decode(t))


@pytest.mark.slow
def test_batched_mixed_and_verify_steps_are_the_decode_steps(qwen3_artifacts):
    """The batched step (decode attention's rows), a mixed step (its decode tokens rotated and
    normed by the step's rotary kernel) and a verify call (its queries) against decode alone."""
    from run_engine import decode_and_verify, greedy_alone_and_batched, mixed_and_separate

    from qwc.runtime.engine import Engine

    eng = Engine(qwen3_artifacts / "fused.qwc", ctx=128)
    prompts = [[72, 101, 108, 108, 111], list(range(3, 40)), [7], list(range(100, 117))]
    alone, batched = greedy_alone_and_batched(eng, prompts, 6)
    np.testing.assert_array_equal(alone, batched)
    mixed, separate = mixed_and_separate(eng, prompts[:3] + [list(range(200, 237))], 8)
    assert np.array_equal(mixed, separate)
    steps, verified = decode_and_verify(eng, prompts[1], [5, 9, 13, 250, 17])
    np.testing.assert_array_equal(verified, steps)
