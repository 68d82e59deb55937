"""A checkpoint read a tensor at a time: its config, its tokenizer, and each weight on demand.

Loaders open a checkpoint (HF safetensors shards, memory-mapped; a GGUF file, memory-mapped)
without reading its weights. `tensor(name)` returns one float32 array in Hugging Face naming
("model.layers.0.self_attn.q_proj.weight", [out, in]), converted from whatever the file holds
(bf16, f16, a GGUF quant type); `blocks(name)` a GGUF's Q4_0 / Q4_1 / Q8_0 weight as it is
(models/gguf_blocks.py). The streaming exporter (models/stream_export.py) reads one
tensor, writes it and lets it go, so no full float32 copy of the model exists; the torch path
builds its model from the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from qwc.config import ModelConfig
from qwc.errors import QwcError

from .gguf_blocks import KEPT, Blocks


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen2 or Qwen3 model of `cfg` needs, with its shape (HF naming; a tied
    lm_head is the embedding, so it is not listed)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return out


def check_dimensions(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str,
                     keys: dict[str, str] | None = None) -> None:
    """Each size the config states against the tensors that hold it (HF naming), naming the
    config's key (`keys`: ModelConfig field -> the file's spelling, where it differs): a
    hand-edited depth or width is one line here, not a loop over a billion layers or a shape
    error deep in a later stage."""
    keys = keys or {}
    layers = {k.split(".")[2] for k in shapes if k.startswith("model.layers.")}
    if cfg.num_hidden_layers > len(layers):
        raise QwcError(f"{source}: {keys.get('num_hidden_layers', 'num_hidden_layers')} {cfg.num_hidden_layers} is "
                       f"more layers than the tensors hold ({len(layers)})")
    q, kv = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    sizes = [("vocab_size", cfg.vocab_size, "model.embed_tokens.weight", 0),
             ("hidden_size", cfg.hidden_size, "model.embed_tokens.weight", 1),
             ("intermediate_size", cfg.intermediate_size, "model.layers.0.mlp.gate_proj.weight", 0),
             ("num_attention_heads", cfg.num_attention_heads * cfg.head_dim, q, 0),
             ("num_key_value_heads", cfg.num_key_value_heads * cfg.head_dim, kv, 0)]
    for f, size, tensor, axis in sizes:
        shape = shapes.get(tensor)
        if shape is None or len(shape) != 2 or shape[axis] == size:
            continue
        key, value = keys.get(f, f), getattr(cfg, f)
        if f in ("num_attention_heads", "num_key_value_heads"):
            raise QwcError(f"{source}: {key} {value} x head dim {cfg.head_dim} = {size} rows, but {tensor} has "
                           f"{shape[0]}")
        raise QwcError(f"{source}: {key} {value} does not fit the tensors ({tensor} is {list(shape)})")


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    source: str
    shapes: dict[str, tuple[int, ...]]            # what the file holds, HF naming
    read: Callable[[str], np.ndarray]            # name -> float32 array, read now
    zero_biases: bool = False                    # Llama files: q/k/v biases are zero
    # A GGUF's quantized weights: name -> its GGUF type ("Q4_1", "Q6_K", ...), and the
    # blocks of those kept as they are (models/gguf_blocks.py), read now.
    quant_types: dict[str, str] = field(default_factory=dict)
    read_blocks: Callable[[str], Blocks] | None = None
    # name -> the float type the file stores it in where that is narrower than float32
    # ("BF16", "F16"): the streamed export writes those matrices in it (qwc/half_floats.py)
    stored: dict[str, str] = field(default_factory=dict)
    # ModelConfig field -> the key the file spells it with (a GGUF's "qwen2.block_count"), for
    # messages; a field not listed is named as it is (a config.json's own spelling)
    keys: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Every tensor the config implies is there with its shape, before anything is written."""
        check_dimensions(self.config, self.shapes, self.source, self.keys)
        want = expected_tensors(self.config)
        missing = [k for k in want if k not in self.shapes
                   and not (self.zero_biases and k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")))]
        if missing:
            raise QwcError(f"{self.source}: checkpoint lacks {missing[0]}"
                           + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
        for k, shape in want.items():
            if k in self.shapes and tuple(self.shapes[k]) != shape:
                raise QwcError(f"{self.source}: tensor {k} has shape {tuple(self.shapes[k])}, "
                               f"the config implies {shape}")

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.shapes and self.zero_biases and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            return np.zeros(expected_tensors(self.config)[name], np.float32)
        return self.read(name)

    def blocks(self, name: str) -> Blocks | None:
        """The weight's blocks where the file holds it in a format qwc keeps, else None."""
        if self.read_blocks is None or self.quant_types.get(name) not in KEPT:
            return None
        return self.read_blocks(name)

    def n_params(self) -> int:
        return sum(int(np.prod(s)) for s in expected_tensors(self.config).values())
