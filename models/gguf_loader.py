"""Loading a GGUF file of `llama`, `qwen2` or `qwen3` architecture as a Qwen2 or Qwen3 checkpoint.

Every tensor can be read dequantized to float32 with the `gguf` package; weights in Q4_0,
Q4_1 or Q8_0 can also be read as their blocks (models/gguf_blocks.py), which the streaming
exporter writes as they are. A Llama model is a
Qwen2 model whose q/k/v biases are zero. llama.cpp's converter permutes the q and k
rows of `llama` files for its rotary layout (`qwen2` files are stored unpermuted), so
those rows are put back here: get that wrong and the text is garbage while nothing fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from qwc import field_checks, half_floats
from qwc.config import ModelConfig, yarn_parameters
from qwc.errors import QwcError
from qwc.rotary import unpermute_rotary_rows

from . import gguf_blocks
from .checkpoint import Checkpoint

if TYPE_CHECKING:
    from .qwen2 import LoadedModel

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# ModelConfig's fields as llama.cpp's metadata keys spell them ({arch}: general.architecture)
GGUF_KEYS = {
    "vocab_size": "{arch}.vocab_size",
    "hidden_size": "{arch}.embedding_length",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length",
    "rope_theta": "{arch}.rope.freq_base",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "{arch}.context_length",
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",   # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


class _TypeNamingReader(GGUFReader):
    """GGUFReader that names the tensor whose type id no GGML type has (gguf's own error gives
    only the number). Hooks its tensor-table step, `_build_tensors` (gguf 0.19.0, pinned)."""

    def _build_tensors(self, start_offs, fields) -> None:
        known = {int(t) for t in GGMLQuantizationType}
        for field in fields:
            type_id = int(field.parts[4][0])
            if type_id not in known:
                name = bytes(field.parts[1]).decode(errors="replace")
                raise ValueError(f"tensor {name} has type id {type_id}, which is no GGML type this gguf package "
                                 "knows (a newer format?)")
        super()._build_tensors(start_offs, fields)


def _open(path: Path) -> GGUFReader:
    try:
        return _TypeNamingReader(path)
    except FileNotFoundError:
        raise QwcError(f"{path}: no such file") from None
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise QwcError(f"{path}: corrupt or unsupported GGUF file ({e})") from None


def _field(reader: GGUFReader, key: str, default=None, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise QwcError(f"GGUF metadata lacks {key}")
        return default
    return f.contents()


def _rope_scaling(reader: GGUFReader, arch: str, path: Path) -> dict | None:
    """llama.cpp's rope scaling keys as ModelConfig's YaRN dict (None: none); another kind is
    refused, as the HF config's is."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none", required=False)
    if kind == "none":
        return None
    if kind != "yarn":
        raise QwcError(f"{path}: unsupported rope scaling {kind!r} (qwc takes YaRN, Qwen2.5's)")
    rope = {"rope_type": "yarn", "factor": _field(reader, f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": _field(reader, f"{arch}.rope.scaling.original_context_length")}
    for key, field in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        v = _field(reader, f"{arch}.rope.scaling.{field}", required=False)
        if v is not None:
            rope[key] = v
    return yarn_parameters(rope, str(path))


def _count(reader: GGUFReader, path: Path, key: str, default=None, lo: int = 1) -> int:
    """An integer metadata value (llama.cpp's uint32 keys), checked before any arithmetic."""
    return field_checks.integer(path, key, _field(reader, key, default), lo)


def _token_id(reader: GGUFReader, path: Path, key: str, vocab: int) -> int | None:
    v = _field(reader, key, required=False)
    return None if v is None else field_checks.integer(path, key, v, lo=0, hi=vocab - 1)


def config_from_gguf(reader: GGUFReader, path: Path) -> tuple[ModelConfig, str]:
    """The file's metadata as a ModelConfig: every key checked by type and range, and the
    head arithmetic by divisibility, before it is used; `keys` names each field's GGUF key
    (for the cross-check against the tensors' shapes, models/checkpoint.py)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise QwcError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    k = dict(GGUF_KEYS)
    k.update({f: key.format(arch=arch) for f, key in k.items()})
    hidden = _count(reader, path, k["hidden_size"])
    heads = _count(reader, path, k["num_attention_heads"])
    kv_heads = _count(reader, path, k["num_key_value_heads"], heads)
    if k["head_dim"] in reader.fields:
        head_dim = _count(reader, path, k["head_dim"])
    else:
        field_checks.multiple(path, k["hidden_size"], hidden, k["num_attention_heads"], heads)
        head_dim = hidden // heads
    field_checks.multiple(path, k["num_attention_heads"], heads, k["num_key_value_heads"], kv_heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise QwcError(f"{path}: GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    vocab = _count(reader, path, k["vocab_size"], len(tokens.data))
    eos = _token_id(reader, path, "tokenizer.ggml.eos_token_id", vocab)
    eot = _token_id(reader, path, "tokenizer.ggml.eot_token_id", vocab)
    eos_ids = [int(x) for x in dict.fromkeys(v for v in (eos, eot) if v is not None)]
    name = _field(reader, "general.name", path.stem, required=False)
    cfg = ModelConfig(
        name=name if isinstance(name, str) else path.stem,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_count(reader, path, k["intermediate_size"]),
        num_hidden_layers=_count(reader, path, k["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=field_checks.positive_number(path, k["rope_theta"], _field(reader, k["rope_theta"], 10000.0)),
        rms_norm_eps=field_checks.positive_number(path, k["rms_norm_eps"], _field(reader, k["rms_norm_eps"])),
        max_position_embeddings=_count(reader, path, k["max_position_embeddings"]),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_token_id(reader, path, "tokenizer.ggml.bos_token_id", vocab),
        eos_token_ids=eos_ids,
        chat_template=_field(reader, "tokenizer.chat_template", required=False),
        rope_scaling=_rope_scaling(reader, arch, path),
        source=str(path),
        architecture="qwen3" if arch == "qwen3" else "qwen2",
    )
    if cfg.chat_template is not None:
        field_checks.string(path, "tokenizer.chat_template", cfg.chat_template)
    if head_dim % 2:
        dim_key = k["head_dim"] if k["head_dim"] in reader.fields else (
            f"{k['hidden_size']} / {k['num_attention_heads']}")
        raise QwcError(f"{path}: {dim_key} {head_dim} must be even for rotary")
    cfg.validate()
    return cfg, arch


def _tokenizer(reader: GGUFReader, path: Path):
    # transformers' GGUF tokenizer builder rebuilds the exact fast tokenizer (vocab, merges,
    # pre-tokenizer split regex, special tokens) from llama.cpp's metadata keys. Its own reader
    # of those keys imports torch, which a GGUF's export must not need: the file is open here,
    # so its fields are handed over under the names the builder reads.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    try:
        tok_dict = {name: reader.fields[f"tokenizer.{key}"].contents()
                    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in reader.fields}
        if "tokens" not in tok_dict:
            raise QwcError(f"{path}: GGUF file has no tokenizer vocabulary")
        tokenizer, _ = convert_gguf_tokenizer(_field(reader, "general.architecture"), tok_dict)
    except QwcError:
        raise
    except Exception as e:
        raise QwcError(f"{path}: cannot build its tokenizer ({str(e).splitlines()[0]})") from None
    return tokenizer


def open_gguf(path: Path) -> Checkpoint:
    """The file's config and tokenizer, with its tensors (memory-mapped by GGUFReader)
    dequantized one at a time on request."""
    path = Path(path)
    reader = _open(path)
    cfg, arch = config_from_gguf(reader, path)
    tokenizer = _tokenizer(reader, path)
    tensors, shapes = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name in ("rope_freqs.weight",):
                raise QwcError(f"{path}: rope frequency scaling ({t.name}) is not supported")
            continue  # e.g. llama.cpp's precomputed rope tables
        # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
        tensors[name], shapes[name] = t, tuple(int(d) for d in reversed(t.shape))

    def rows_in_order(name: str, w: np.ndarray) -> np.ndarray:
        t = tensors[name]
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rotary_rows(w, cfg.num_attention_heads)
        if arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rotary_rows(w, cfg.num_key_value_heads)
        return w

    def read_blocks(name: str) -> gguf_blocks.Blocks:
        t = tensors[name]
        raw = rows_in_order(name, np.asarray(t.data).reshape(shapes[name][0], -1))   # whole rows of blocks
        return gguf_blocks.from_gguf(raw, t.tensor_type.name, shapes[name], t.name)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise QwcError(f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}: {e})") from None
        w = rows_in_order(name, w.reshape(shapes[name]))
        return np.require(w, np.float32, ["C", "W", "O"])   # F32 tensors come back as views of the map

    # Llama has no q/k/v biases: Qwen2's are zero.
    quant = {name: t.tensor_type.name for name, t in tensors.items()
             if t.tensor_type.name not in ("F32", "F16", "BF16", "F64") and len(shapes[name]) == 2}
    # an F16 or BF16 file's matrices (what convert_hf_to_gguf.py writes) stay so in a streamed graph
    narrow = {name: t.tensor_type.name for name, t in tensors.items() if t.tensor_type.name in half_floats.KINDS}
    ckpt = Checkpoint(cfg, tokenizer, str(path), shapes, read, zero_biases=arch == "llama",
                      quant_types=quant, read_blocks=read_blocks, stored=narrow,
                      keys={f: key.format(arch=arch) for f, key in GGUF_KEYS.items()})
    ckpt.check()
    return ckpt


def load_gguf(path: Path) -> LoadedModel:
    from .qwen2 import from_checkpoint

    return from_checkpoint(open_gguf(path), desc="dequantizing GGUF")
