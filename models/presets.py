"""Presets built in code with seeded random weights: no download, same model everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwc import progress
from qwc.config import ModelConfig
from qwc.errors import QwcError

from .tokenizer import CHATML_TEMPLATE, byte_level_tokenizer, special_ids

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

PRESET_NAMES = tuple(_PRESETS)

if TYPE_CHECKING:
    from .qwen2 import LoadedModel


def preset_config(name: str) -> ModelConfig:
    if name not in _PRESETS:
        raise QwcError(f"unknown preset {name!r} (known: {', '.join(PRESET_NAMES)})")
    tok = byte_level_tokenizer()
    bos, eos = special_ids(tok)
    return ModelConfig(name=name, bos_token_id=bos, eos_token_ids=eos,
                       chat_template=CHATML_TEMPLATE, source=f"preset:{name}", **_PRESETS[name][0])


def load_preset(name: str, seed: int = 0) -> LoadedModel:
    import torch  # here, not at import: a preset's name is checked where torch is not installed or loaded

    from .qwen2 import LoadedModel, build_model

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
