"""Qwen2 and Qwen3 in torch: transformers' implementations, configured from qwc's ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qwc.config import ModelConfig
from qwc.errors import QwcError


@dataclass
class LoadedModel:
    model: Qwen2ForCausalLM | Qwen3ForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer


_CLASSES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def hf_config(cfg: ModelConfig, initializer_range: float = 0.02) -> Qwen2Config | Qwen3Config:
    config_class = _CLASSES[cfg.architecture][0]
    hf = config_class(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_parameters={**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        initializer_range=initializer_range,
        use_sliding_window=False,
        **({"attention_bias": False} if cfg.architecture == "qwen3" else {}),
    )
    # Eager attention: the SDPA decomposition does not lower through TVM 0.27.
    hf._attn_implementation = "eager"
    return hf


def build_model(cfg: ModelConfig, initializer_range: float = 0.02) -> Qwen2ForCausalLM | Qwen3ForCausalLM:
    """A float32 model in eval mode with transformers' random initialisation."""
    model = _CLASSES[cfg.architecture][1](hf_config(cfg, initializer_range))
    return model.float().eval()


def from_checkpoint(ckpt, desc: str = "reading weights") -> LoadedModel:
    """A float32 torch model of a lazily opened checkpoint (models/checkpoint.py): the torch
    exporter's, QAT's and eval's input. Each tensor is copied into the model as it is read
    and let go, so the peak is the model and one tensor, not the model twice."""
    from qwc import progress

    from .checkpoint import expected_tensors

    model = build_model(ckpt.config)
    params = dict(model.named_parameters())
    want = expected_tensors(ckpt.config)   # a tied lm_head is the embedding: not listed
    missing = sorted(set(want) - set(ckpt.shapes) - ({k for k in want if k.endswith("_proj.bias")}
                                                      if ckpt.zero_biases else set()))
    if missing:
        raise QwcError(f"{ckpt.source}: checkpoint lacks {missing[0]}"
                       + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    with torch.no_grad():
        for name in progress.bar(list(want), desc=desc, unit="tensor"):
            t = ckpt.tensor(name)
            if tuple(t.shape) != tuple(params[name].shape):
                raise QwcError(f"{ckpt.source}: tensor {name} has shape {tuple(t.shape)}, "
                               f"the config implies {tuple(params[name].shape)}")
            params[name].copy_(torch.from_numpy(t))
            del t
    if ckpt.config.tie_word_embeddings:
        model.tie_weights()
    return LoadedModel(model, ckpt.config, ckpt.tokenizer)
