"""The model description every stage shares, stored as JSON beside each graph.

It holds only what the later stages need (shapes, rotary and norm constants, special
tokens, chat template), so the passes, the compiler and the runtime never import torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import field_checks
from .errors import QwcError

CONFIG_FORMAT = 1
# HF config.json's model_type / ModelConfig.architecture values qwc compiles
ARCHITECTURES = ("qwen2", "qwen3")


YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate", "rope_theta"}


def yarn_parameters(rope: dict, source: str) -> dict:
    """The YaRN parameters of a rope dict (HF's spelling, transformers 4 or 5), checked and
    normalised to {"rope_type": "yarn", "factor", "original_max_position_embeddings", ...}."""
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "yarn":
        raise QwcError(f"{source}: rope scaling {rope!r} is not YaRN")
    unknown = sorted(set(rope) - YARN_KEYS)
    if unknown:
        raise QwcError(f"{source}: unsupported YaRN parameters {', '.join(unknown)}")
    out = {"rope_type": "yarn"}
    for key, kind in (("factor", float), ("original_max_position_embeddings", int), ("beta_fast", float),
                      ("beta_slow", float), ("attention_factor", float), ("mscale", float), ("mscale_all_dim", float)):
        v = rope.get(key)
        if v is None:
            if key in ("factor", "original_max_position_embeddings"):
                raise QwcError(f"{source}: YaRN rope scaling lacks {key}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf") or (
                kind is int and v != int(v)):
            raise QwcError(f"{source}: YaRN {key} {v!r} must be a positive {'integer' if kind is int else 'number'}")
        out[key] = kind(v)
    if out["factor"] < 1:
        raise QwcError(f"{source}: YaRN factor {out['factor']} must be at least 1")
    if "truncate" in rope:
        if not isinstance(rope["truncate"], bool):
            raise QwcError(f"{source}: YaRN truncate {rope['truncate']!r} must be true or false")
        out["truncate"] = rope["truncate"]
    return out


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
    # YaRN (Qwen2.5's long-context setting), as transformers reads it: {"rope_type": "yarn",
    # "factor", "original_max_position_embeddings"[, "beta_fast", "beta_slow",
    # "attention_factor", "mscale", "mscale_all_dim", "truncate"]}; None: plain rotary
    rope_scaling: dict | None = None
    # "qwen2" (Qwen2, Qwen2.5, and Llama files as Qwen2 with zero biases) or "qwen3": Qwen3's
    # dense models, an RMSNorm over each head of q and of k before rotary and no q/k/v
    # biases (models/checkpoint.py: expected_tensors)
    architecture: str = "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Each layer has q_norm and k_norm, gains of head_dim applied per head."""
        return self.architecture == "qwen3"

    @property
    def attention_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def context_length(self) -> int:
        """Positions the model serves: max_position_embeddings, or with YaRN the original
        positions times the factor (Qwen2.5: 32768 x 4) where that is more."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        r = self.rope_scaling
        return max(self.max_position_embeddings, int(r["factor"] * r["original_max_position_embeddings"]))

    def validate(self) -> None:
        """Types and ranges, so an impossible config (a hand-edited config.json or manifest) is
        one line here rather than a shape error deep in a later stage."""
        def integer(name, lo=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise QwcError(f"{self.name}: {name} {v!r} must be an integer >= {lo}")
        def positive(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
                raise QwcError(f"{self.name}: {name} {v!r} must be a positive finite number")
        if not isinstance(self.name, str):
            raise QwcError(f"model name {self.name!r} must be a string")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            integer(f)
        positive("rope_theta")
        positive("rms_norm_eps")
        if self.num_attention_heads % self.num_key_value_heads:
            raise QwcError(
                f"{self.name}: {self.num_attention_heads} attention heads is not a multiple "
                f"of {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise QwcError(f"{self.name}: head_dim {self.head_dim} must be even for rotary")
        specials = ([] if self.bos_token_id is None else [self.bos_token_id]) + (
            self.eos_token_ids if isinstance(self.eos_token_ids, list) else [self.eos_token_ids])
        for t in specials:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise QwcError(f"{self.name}: special token id {t!r} is not in the vocabulary [0, {self.vocab_size})")
        if not isinstance(self.tie_word_embeddings, bool):
            raise QwcError(f"{self.name}: tie_word_embeddings {self.tie_word_embeddings!r} must be true or false")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise QwcError(f"{self.name}: chat_template must be a string")
        if self.architecture not in ARCHITECTURES:
            raise QwcError(f"{self.name}: architecture {self.architecture!r} is not one qwc compiles "
                           f"({', '.join(ARCHITECTURES)})")
        if self.rope_scaling is not None:
            self.rope_scaling = yarn_parameters(self.rope_scaling, self.name)


    def to_json(self) -> str:
        return json.dumps({"qwc_config_format": CONFIG_FORMAT, **dataclasses.asdict(self)}, indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise QwcError("model config is not a JSON object")
        fmt = d.get("qwc_config_format")
        if fmt != CONFIG_FORMAT:
            raise QwcError(f"model config format {fmt!r} is not supported (expected {CONFIG_FORMAT})")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise QwcError(f"model config lacks {', '.join(missing)}")
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.validate()
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict, name: str, source: str) -> "ModelConfig":
        """From a Hugging Face Qwen2 or Qwen3 config.json (either transformers 4 or 5 spelling)."""
        if not isinstance(d, dict):
            raise QwcError(f"{source}: not a JSON object")
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise QwcError(f"{source}: unsupported architecture {arch!r} "
                           "(qwc compiles Qwen2, Qwen2.5 and Qwen3's dense models)")
        # Qwen3's attention_bias is false in every published config; a true one would need
        # biases this architecture's graph does not have
        if arch == "qwen3" and d.get("attention_bias"):
            raise QwcError(f"{source}: attention_bias true is not supported for qwen3 (its models have none)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise QwcError(f"{source}: rope parameters {rope!r} are not a JSON object")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise QwcError(f"{source}: unsupported rope scaling {kind!r} (qwc takes YaRN, Qwen2.5's)")
        scaling = yarn_parameters(rope, source) if kind == "yarn" else None
        if d.get("use_sliding_window"):
            raise QwcError(f"{source}: sliding-window attention is not supported")

        def count(key, default=None):
            if key not in d and default is None:
                raise QwcError(f"{source}: config lacks {key}")
            return field_checks.integer(source, key, d.get(key, default))

        hidden = count("hidden_size")
        heads = count("num_attention_heads")
        # null means "as many as the attention heads" / "hidden / heads", as transformers reads them
        kv_heads = count("num_key_value_heads", heads) if d.get("num_key_value_heads") is not None else heads
        if d.get("head_dim") is not None:
            head_dim = count("head_dim")
        else:
            field_checks.multiple(source, "hidden_size", hidden, "num_attention_heads", heads)
            head_dim = hidden // heads
        field_checks.multiple(source, "num_attention_heads", heads, "num_key_value_heads", kv_heads)
        vocab = count("vocab_size")
        # transformers 5 writes it inside rope_parameters, 4 at the top level
        where = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        theta_key = f"{where}.rope_theta" if "rope_theta" in rope else "rope_theta"
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        cfg = cls(
            name=name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_hidden_layers=count("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=field_checks.positive_number(source, theta_key, theta),
            rms_norm_eps=field_checks.positive_number(source, "rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=count("max_position_embeddings", 32768),
            tie_word_embeddings=field_checks.flag(source, "tie_word_embeddings", d.get("tie_word_embeddings", False)),
            bos_token_id=_token_ids(source, "bos_token_id", d.get("bos_token_id"), vocab, many=False),
            eos_token_ids=_token_ids(source, "eos_token_id", d.get("eos_token_id"), vocab, many=True),
            source=source,
            rope_scaling=scaling,
            architecture=arch,
        )
        cfg.validate()
        return cfg

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise QwcError(f"model config {path} not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise QwcError(f"model config {path} is not valid JSON: {e}") from None


def _token_ids(source: str, key: str, value, vocab: int, many: bool):
    """A config.json's special token id (`many`: an id or a list of them; null: none) checked
    against the vocabulary: [ids] with `many`, else the id or None."""
    if value is None:
        return [] if many else None
    if many and isinstance(value, list):
        return [field_checks.integer(source, key, v, lo=0, hi=vocab - 1) for v in value]
    v = field_checks.integer(source, key, value, lo=0, hi=vocab - 1)
    return [v] if many else v


def load_for_graph(onnx_path: Path) -> ModelConfig:
    """The config of a graph: qwc's `<stem>.config.json`, else a Hugging Face `config.json`
    beside it (as optimum and onnxruntime-genai write)."""
    p = Path(onnx_path)
    if p.is_dir() or p.suffix.lower() == ".gguf":
        # A checkpoint where a graph belongs: say what to run, not which sidecar is missing.
        raise QwcError(f"{p} is a checkpoint ({'a directory' if p.is_dir() else 'GGUF'}), not an ONNX graph: "
                       f"run `qwc export {p} -o model.onnx` first")
    own, _ = sidecar_paths(onnx_path)
    if own.is_file():
        return ModelConfig.load(own)
    hf = Path(onnx_path).with_name("config.json")
    if hf.is_file():
        try:
            d = json.loads(hf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise QwcError(f"{hf} is not valid JSON: {e}") from None
        return ModelConfig.from_hf_dict(d, name=Path(onnx_path).stem, source=str(hf))
    raise QwcError(f"no model config for {onnx_path}: expected {own.name} or config.json beside it")


def tokenizer_for_graph(onnx_path: Path) -> Path | None:
    _, own = sidecar_paths(onnx_path)
    if own.is_file():
        return own
    hf = Path(onnx_path).with_name("tokenizer.json")
    return hf if hf.is_file() else None


def sidecar_paths(onnx_path: Path) -> tuple[Path, Path]:
    """Where the model config and tokenizer of `dir/name.onnx` live: `dir/name.config.json`,
    `dir/name.tokenizer.json` (named after the graph so several graphs share a folder)."""
    onnx_path = Path(onnx_path)
    stem = onnx_path.name[:-5] if onnx_path.name.endswith(".onnx") else onnx_path.name
    return onnx_path.with_name(stem + ".config.json"), onnx_path.with_name(stem + ".tokenizer.json")


def foreign_graph_files(onnx_path: Path) -> str | None:
    """What among the files a graph output writes (`name.onnx`, `name.onnx.data` and the two
    sidecars) qwc did not write (None: nothing): they are qwc's when the config sidecar beside
    them is one qwc wrote, since every qwc graph is written with it (qwc.atomic)."""
    onnx_path = Path(onnx_path)
    cfg, tok = sidecar_paths(onnx_path)
    existing = [p for p in (onnx_path, onnx_path.with_name(onnx_path.name + ".data"), cfg, tok) if p.exists()]
    if not existing:
        return None
    try:
        d = json.loads(cfg.read_text())
        ours = isinstance(d, dict) and "qwc_config_format" in d
    except (OSError, ValueError, TypeError):
        ours = False
    return None if ours else f"{existing[0].name} exists and qwc did not write it (no qwc {cfg.name} beside it)"
