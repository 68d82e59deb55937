"""Qwen2 in torch: transformers' implementation, configured from qwc's ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

from qwc.config import ModelConfig
from qwc.errors import QwcError


@dataclass
class LoadedModel:
    model: Qwen2ForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer


def hf_config(cfg: ModelConfig, initializer_range: float = 0.02) -> Qwen2Config:
    hf = Qwen2Config(
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
    )
    # Eager attention: the SDPA decomposition does not lower through TVM 0.27.
    hf._attn_implementation = "eager"
    return hf


def build_model(cfg: ModelConfig, initializer_range: float = 0.02) -> Qwen2ForCausalLM:
    """A float32 model in eval mode with transformers' random initialisation."""
    model = Qwen2ForCausalLM(hf_config(cfg, initializer_range))
    return model.float().eval()


def load_state(model: Qwen2ForCausalLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Load HF-named float tensors, insisting every parameter is covered with its shape."""
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise QwcError(f"{source}: checkpoint lacks {missing[0]}"
                       + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise QwcError(f"{source}: tensor {k} has shape {tuple(state[k].shape)}, "
                           f"the config implies {tuple(shape)}")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def from_checkpoint(ckpt, desc: str = "reading weights") -> LoadedModel:
    """A float32 torch model of a lazily opened checkpoint (models/checkpoint.py): the torch
    exporter's, QAT's and eval's input."""
    from qwc import progress

    from .checkpoint import expected_tensors

    model = build_model(ckpt.config)
    names = list(expected_tensors(ckpt.config))
    state = {k: torch.from_numpy(ckpt.tensor(k)) for k in progress.bar(names, desc=desc, unit="tensor")}
    load_state(model, state, ckpt.source)
    return LoadedModel(model, ckpt.config, ckpt.tokenizer)
