"""Loading checkpoints: a Hugging Face directory and GGUF files (llama and qwen2), each
written by the test, exported, and compared with torch on the original weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from gguf import GGMLQuantizationType, TokenType
from gguf.quants import dequantize, quantize

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.models.gguf_loader import load_gguf
from qwc.models.gguf_writer import write_gguf
from qwc.models.qwen2 import build_model
from qwc.models.tokenizer import SPECIAL_TOKENS, byte_level_tokenizer

from conftest import ort_kv_logits, torch_kv_logits


def _compare_export(onnx_path, ref_model, cfg, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, (1, 8))
    steps = [rng.integers(0, cfg.vocab_size, (1, 1)) for _ in range(4)]
    ref = torch_kv_logits(ref_model, prompt, steps)
    got = ort_kv_logits(onnx_path, cfg, prompt, steps)
    for r, g in zip(ref, got):
        assert np.abs(r - g).max() < 1e-4


@pytest.mark.slow
def test_hf_directory_round_trip(tiny_lm, tmp_path):
    src = tmp_path / "hf"
    tiny_lm.model.save_pretrained(src)  # config.json + model.safetensors
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    out = tmp_path / "hf.onnx"
    assert main(["-q", "export", str(src), "-o", str(out)]) == 0
    cfg = ModelConfig.load(sidecar_paths(out)[0])
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (128, 2, True)
    _compare_export(out, tiny_lm.model, cfg)


# --- GGUF -----------------------------------------------------------------------------

def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of a `llama` file (the loader undoes it)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(arch: str) -> ModelConfig:
    tok = byte_level_tokenizer()
    return ModelConfig(
        name=f"tiny-{arch}", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=(arch == "llama"), bos_token_id=256, eos_token_ids=[258],
        chat_template="{{ messages }}")


def _write_gguf(path, arch: str, cfg: ModelConfig, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write `state` (HF names) as a GGUF, 2-D tensors as Q8_0 like real files, q/k rows
    permuted for `llama`; return the float weights the file really holds."""
    tok = byte_level_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t, _ in vocab]
    held, tensors = {}, {}
    for k, v in state.items():
        if arch == "llama" and k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            continue
        if v.ndim == 2:
            stored, qtype = quantize(v, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
            held[k] = dequantize(stored, qtype).reshape(v.shape)
        else:
            stored, qtype = v, None
            held[k] = v
        if arch == "llama" and ("q_proj" in k or "k_proj" in k):
            heads = cfg.num_attention_heads if "q_proj" in k else cfg.num_key_value_heads
            stored = _llama_permute(stored, heads)
        tensors[k] = (stored, qtype)
    write_gguf(path, arch, cfg, [t for t, _ in vocab], types, tensors)
    return held


def _make_gguf(tmp_path, arch: str):
    cfg = _gguf_config(arch)
    torch.manual_seed(1)
    model = build_model(cfg, initializer_range=0.1)
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = np.random.default_rng(2).uniform(0.5, 1.5, state[k].shape).astype(np.float32)
        if k.endswith("_proj.bias"):
            state[k] = (0.1 * np.random.default_rng(3).standard_normal(state[k].shape)).astype(np.float32)
    path = tmp_path / f"tiny-{arch}.gguf"
    held = _write_gguf(path, arch, cfg, state)
    ref = build_model(cfg)
    full = {k: torch.from_numpy(v) for k, v in held.items()}
    for k, v in ref.state_dict().items():
        if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and k not in full:
            full[k] = torch.zeros_like(v)  # llama: no biases
    ref.load_state_dict(full, strict=not cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        ref.tie_weights()
    return path, cfg, ref


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip(tmp_path, arch):
    path, cfg, ref = _make_gguf(tmp_path, arch)
    lm = load_gguf(path)
    assert lm.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert lm.config.eos_token_ids == [258] and lm.config.chat_template == "{{ messages }}"
    for k, v in ref.state_dict().items():
        assert torch.equal(lm.model.state_dict()[k], v), k
    assert lm.tokenizer.encode("héllo<|im_end|>").ids == byte_level_tokenizer().encode("héllo<|im_end|>").ids
    out = tmp_path / f"{arch}.onnx"
    assert main(["-q", "export", str(path), "-o", str(out)]) == 0
    _compare_export(out, ref, ModelConfig.load(sidecar_paths(out)[0]))
    # a Llama file's q/k/v have no bias: the graph adds none (a Qwen2 file's are its own)
    g = onnx.load(str(out), load_external_data=False).graph
    biased = [n for n in g.node if any(i.endswith("proj.bias") for i in n.input)]
    assert (len(biased) == 0) == (arch == "llama"), [n.name for n in biased][:3]


def test_gguf_llama_matches_transformers_own_loader(tmp_path):
    """An independent check of the q/k un-permutation: transformers reads the same file
    as a LlamaForCausalLM, and its logits must equal ours."""
    from transformers import LlamaForCausalLM

    path, cfg, _ = _make_gguf(tmp_path, "llama")
    theirs = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_gguf(path).model
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 12)))
    with torch.no_grad():
        a = ours(input_ids=ids).logits
        b = theirs(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
