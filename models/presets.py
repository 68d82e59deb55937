"""Presets built in code with seeded random weights: no download, same model everywhere.

Qwen2 presets are transformers' own random initialisation in torch. Qwen3 presets, and the
whole Qwen2.5 7B, 14B and 32B (too large to build in torch here), are checkpoints made in code
(`preset_checkpoint`): each tensor drawn from a generator seeded by its name when it is read,
so the full-size shapes export through the streaming writer in bounded memory, as a
downloaded checkpoint does, and the torch reference loads the same tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwc import progress
from qwc.config import ModelConfig
from qwc.errors import QwcError

from .checkpoint import Checkpoint, expected_tensors
from .tokenizer import CHATML_TEMPLATE, QWEN3_TEMPLATE, THINK_TOKENS, byte_level_tokenizer, special_ids

# name -> (config fields, initializer std). Tiny's larger std gives logits with clear
# winners, so greedy decoding is a meaningful check rather than a coin toss on ties.
_PRESETS: dict[str, tuple[dict, float]] = {
    "tiny": (dict(
        vocab_size=288,            # 259 byte-level tokens, padded to a multiple of 32 as Qwen pads
        hidden_size=128,
        intermediate_size=320,     # 10 blocks of 32: not a multiple of 128 on purpose
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ), 0.15),
    "qwen2.5-0.5b": (dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ), 0.02),
    # Qwen2.5-7B's layer and vocabulary shapes with 4 of its 28 layers: its per-layer work
    # and parallel behaviour at a size that exports, compiles and runs under emulation
    # (bench/arm_threads.py scales per-layer figures to 28 layers).
    "qwen2.5-7b-4layers": (dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=4,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ), 0.02),
}



def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool, vocab: int = 151936,
           head_dim: int = 128, kv_heads: int = 8) -> dict:
    """A Qwen3 dense model's config fields (the published config.json's values)."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                tie_word_embeddings=tied, architecture="qwen3")


# Qwen3 presets: name -> (config fields, the matrices' standard deviation). The 2-layer cuts
# keep a shape's per-layer work and vocabulary at a size that exports, compiles and runs
# under emulation.
_QWEN3_PRESETS: dict[str, tuple[dict, float]] = {
    # head_dim 64 is not hidden / heads (32), as in every Qwen3 (128 against 1024 / 16 in 0.6B)
    "tiny-qwen3": (_qwen3(128, 320, 2, 4, True, vocab=288, head_dim=64, kv_heads=2) | dict(
        rope_theta=10000.0, max_position_embeddings=2048), 0.15),
    "qwen3-0.6b": (_qwen3(1024, 3072, 28, 16, True), 0.02),
    "qwen3-1.7b": (_qwen3(2048, 6144, 28, 16, True), 0.02),
    "qwen3-4b": (_qwen3(2560, 9728, 36, 32, True), 0.02),
    "qwen3-8b": (_qwen3(4096, 12288, 36, 32, False), 0.02),
    "qwen3-14b": (_qwen3(5120, 17408, 40, 40, False), 0.02),
    "qwen3-32b": (_qwen3(5120, 25600, 64, 64, False), 0.02),
    "qwen3-8b-2layers": (_qwen3(4096, 12288, 2, 32, False), 0.02),
    # with the 2-layer cut, the work of whole layers (the cuts' difference: the last is partial)
    "qwen3-8b-4layers": (_qwen3(4096, 12288, 4, 32, False), 0.02),
    "qwen3-32b-2layers": (_qwen3(5120, 25600, 2, 64, False), 0.02),
}


def _qwen25(intermediate: int, layers: int, hidden: int = 5120, heads: int = 40, kv_heads: int = 8) -> dict:
    """A Qwen2.5 model's config fields (the published config.json's values; heads of 128,
    untied embeddings from 7B up)."""
    return dict(vocab_size=152064, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, rope_theta=1000000.0,
                rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False)


# Qwen2.5 presets made as checkpoints, for the routes that write no float checkpoint
# (bench/scale.py --gguf): the 7B for start times, 14B and 32B whose torch model would not fit
# this machine's memory.
_QWEN25_CHECKPOINT_PRESETS: dict[str, tuple[dict, float]] = {
    "qwen2.5-7b": (_qwen25(18944, 28, hidden=3584, heads=28, kv_heads=4), 0.02),
    "qwen2.5-14b": (_qwen25(13824, 48), 0.02),
    "qwen2.5-32b": (_qwen25(27648, 64), 0.02),
}
_CHECKPOINT_PRESETS = _QWEN3_PRESETS | _QWEN25_CHECKPOINT_PRESETS

PRESET_NAMES = tuple(_PRESETS) + tuple(_CHECKPOINT_PRESETS)

if TYPE_CHECKING:
    from .qwen2 import LoadedModel


def is_checkpoint_preset(name: str) -> bool:
    """A preset made as a checkpoint (preset_checkpoint), which exports as one does."""
    return name in _CHECKPOINT_PRESETS


def preset_config(name: str) -> ModelConfig:
    if name not in PRESET_NAMES:
        raise QwcError(f"unknown preset {name!r} (known: {', '.join(PRESET_NAMES)})")
    qwen3 = name in _QWEN3_PRESETS
    bos, eos = special_ids(_preset_tokenizer(name))
    fields = (_CHECKPOINT_PRESETS if is_checkpoint_preset(name) else _PRESETS)[name][0]
    return ModelConfig(name=name, bos_token_id=bos, eos_token_ids=eos, chat_template=QWEN3_TEMPLATE if qwen3 else CHATML_TEMPLATE,
                       source=f"preset:{name}", **fields)


def _preset_tokenizer(name: str):
    return byte_level_tokenizer(THINK_TOKENS if name in _QWEN3_PRESETS else ())


def preset_checkpoint(name: str, seed: int = 0) -> Checkpoint:
    """A preset made as a checkpoint (Qwen3's; Qwen2.5's 7B, 14B and 32B): each tensor made
    when read, from a generator seeded by (seed, the tensor's name), so it is the same in every
    reader and order. Norm gains (q_norm and k_norm's too) lie in [0.5, 1.5], so passes that
    fold or fuse them meet real values."""
    import zlib

    import numpy as np

    if not is_checkpoint_preset(name):
        raise QwcError(f"{name} is a preset built in torch, not a checkpoint")
    cfg, std = preset_config(name), _CHECKPOINT_PRESETS[name][1]
    shapes = expected_tensors(cfg)

    def read(tensor: str) -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(tensor.encode())])
        shape = shapes[tensor]
        if tensor.endswith("norm.weight"):
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        out = np.empty(shape, np.float32)
        for r in range(0, shape[0], 4096):   # a row chunk at a time: no float64 copy of a 600 MB table
            out[r:r + 4096] = rng.standard_normal((min(4096, shape[0] - r), *shape[1:]), np.float32) * std
        return out

    return Checkpoint(cfg, _preset_tokenizer(name), f"preset:{name}", dict(shapes), read)


def load_preset(name: str, seed: int = 0) -> LoadedModel:
    import torch  # here, not at import: a preset's name is checked where torch is not installed or loaded

    from .qwen2 import LoadedModel, build_model, from_checkpoint

    if is_checkpoint_preset(name):
        with progress.stage(f"building preset {name} (seed {seed})"):
            return from_checkpoint(preset_checkpoint(name, seed), desc="making weights")
    cfg = preset_config(name)
    with progress.stage(f"building preset {name} (seed {seed})"):
        torch.manual_seed(seed)
        model = build_model(cfg, initializer_range=_PRESETS[name][1])
        # Non-trivial norm gains and q/k/v biases, so passes that fold or fuse them
        # are tested on real values rather than ones and zeros.
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if name_.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name_.endswith("_proj.bias"):
                    p.normal_(0.0, 0.1)
    return LoadedModel(model, cfg, byte_level_tokenizer())
