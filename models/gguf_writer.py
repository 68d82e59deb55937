"""Writing a Qwen2 / Qwen3 / Llama model as a GGUF file: the metadata llama.cpp reads, and tensors
named the way `gguf_loader` maps them back. Used to hand llama.cpp the same weights as qwc
(bench/) and to build GGUF files for the loader's tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

from qwc import progress
from qwc.config import ModelConfig

from .gguf_loader import _GLOBAL_TENSORS, _LAYER_TENSORS

_HF_GLOBAL = {hf: g for g, hf in _GLOBAL_TENSORS.items()}
_HF_LAYER = {hf: g for g, hf in _LAYER_TENSORS.items()}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{i}.{_HF_LAYER[rest]}"


@dataclass
class Planned:
    """A tensor made when its turn to be written comes, so a large model is never whole in
    memory: its stored shape (bytes per row for a quantized type) and dtype up front."""
    shape: tuple[int, ...]
    dtype: np.dtype
    qtype: GGMLQuantizationType | None
    make: Callable[[], np.ndarray]


def write_gguf(path: Path, arch: str, cfg: ModelConfig, tokens: list[str], token_types: list[int],
               tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None] | Planned],
               merges: list[str] | None = None, file_type: int | None = None) -> Path:
    """`tensors`: HF name -> (array, quantization type of its raw bytes, None for float), or a
    Planned tensor."""
    w = GGUFWriter(str(path), arch)
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:   # as llama.cpp's converter: only where it differs
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling is not None:   # YaRN, as llama.cpp's converter writes Qwen2.5's
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling["original_max_position_embeddings"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges or [])
    w.add_token_scores([0.0] * len(tokens))
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    if cfg.chat_template:
        w.add_chat_template(cfg.chat_template)
    plan = {}
    for name, t in tensors.items():
        if not isinstance(t, Planned):
            data, qtype = t
            data = np.ascontiguousarray(data)
            t = Planned(data.shape, data.dtype, qtype, lambda data=data: data)
        plan[name] = t
        nbytes = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        w.add_tensor_info(gguf_name(name), t.shape, np.dtype(t.dtype), nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, t in progress.bar(plan.items(), total=len(plan), desc="writing tensors", unit="tensor"):
        data = np.ascontiguousarray(t.make())   # in the order of the tensor infos
        if data.shape != tuple(t.shape) or data.dtype != t.dtype:
            raise ValueError(f"{name}: made {data.dtype}{list(data.shape)}, planned {np.dtype(t.dtype)}{list(t.shape)}")
        w.write_tensor_data(data)
    w.close()
    return Path(path)
