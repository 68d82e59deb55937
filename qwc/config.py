"""The model description every stage shares, stored as JSON beside each graph.

It holds only what the later stages need (shapes, rotary and norm constants, special
tokens, chat template), so the passes, the compiler and the runtime never import torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QwcError

CONFIG_FORMAT = 1


@dataclass
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    source: str = ""

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise QwcError(
                f"{self.name}: {self.num_attention_heads} attention heads is not a multiple "
                f"of {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise QwcError(f"{self.name}: head_dim {self.head_dim} must be even for rotary")

    def to_json(self) -> str:
        return json.dumps({"qwc_config_format": CONFIG_FORMAT, **dataclasses.asdict(self)}, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        fmt = d.get("qwc_config_format")
        if fmt != CONFIG_FORMAT:
            raise QwcError(f"model config format {fmt!r} is not supported (expected {CONFIG_FORMAT})")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise QwcError(f"model config lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise QwcError(f"model config {path} not found") from None
        except json.JSONDecodeError as e:
            raise QwcError(f"model config {path} is not valid JSON: {e}") from None


def sidecar_paths(onnx_path: Path) -> tuple[Path, Path]:
    """Where the model config and tokenizer of `dir/name.onnx` live: `dir/name.config.json`,
    `dir/name.tokenizer.json` (named after the graph so several graphs share a folder)."""
    onnx_path = Path(onnx_path)
    stem = onnx_path.name[:-5] if onnx_path.name.endswith(".onnx") else onnx_path.name
    return onnx_path.with_name(stem + ".config.json"), onnx_path.with_name(stem + ".tokenizer.json")
