"""Write a transformers Qwen2 model as a llama.cpp GGUF with Q4_0 weights (embedding and tied
lm_head included, as in the contest runs), so llama.cpp runs the same weights as qwc.

Token ids are fed directly in the benchmark; the vocabulary is the preset's byte-level one,
padded with unused entries to the embedding's row count (llama.cpp wants them equal)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf_q4_0(lm, path: Path) -> Path:
    cfg = lm.config
    w = GGUFWriter(str(path), "qwen2")
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(2)  # MOSTLY_Q4_0
    vocab = sorted(lm.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(vocab))]
    types = [TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t, _ in vocab]
    types += [TokenType.UNUSED] * (cfg.vocab_size - len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 \u0120"])  # llama.cpp refuses a BPE vocabulary without merges
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    for name, t in lm.model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_LAYER[rest]}"
        a = t.detach().float().numpy()
        if a.ndim == 2:
            q = quantize(a, GGMLQuantizationType.Q4_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
