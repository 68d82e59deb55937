"""Loading checkpoints: a Hugging Face directory and GGUF files (llama and qwen2), each
written by the test, exported, and compared with torch on the original weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.models.gguf_loader import load_gguf
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
    """Write `state` (HF names) as a GGUF; return the float weights the file really holds."""
    w = GGUFWriter(str(path), arch)
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    tok = byte_level_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(vocab))
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_chat_template(cfg.chat_template)
    held = {}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for k, v in state.items():
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            gname = f"blk.{i}.{layer[rest]}"
        else:
            gname = names[k]
        if arch == "llama" and k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            continue
        if v.ndim == 2:
            # Linears and the embedding as Q8_0, as real files store them.
            q = quantize(v, GGMLQuantizationType.Q8_0)
            held[k] = dequantize(q, GGMLQuantizationType.Q8_0).reshape(v.shape)
            stored, qtype = q, GGMLQuantizationType.Q8_0
        else:
            held[k] = v
            stored, qtype = v, None
        if arch == "llama" and ("q_proj" in k or "k_proj" in k):
            heads = cfg.num_attention_heads if "q_proj" in k else cfg.num_key_value_heads
            stored = _llama_permute(stored, heads)
        if qtype is None:
            w.add_tensor(gname, stored)
        else:
            w.add_tensor(gname, stored, raw_shape=stored.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
