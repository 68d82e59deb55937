"""Loading a Hugging Face Qwen2 or Qwen3 directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen3Config

from qwc import half_floats
from qwc.atomic import replace_dir, staging_dir
from qwc.config import ARCHITECTURES, ModelConfig
from qwc.errors import QwcError
from qwc.text import read_json_object

from .checkpoint import Checkpoint, check_dimensions

if TYPE_CHECKING:
    from .qwen2 import LoadedModel


def open_hf_dir(path: Path) -> Checkpoint:
    """The directory's config and tokenizer, and its safetensors shards opened memory-mapped:
    no weight is read until asked for."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise QwcError(f"{path}: not a Hugging Face model directory (no config.json)")
    raw = read_json_object(cfg_path)
    if raw.get("model_type") not in ARCHITECTURES:
        raise QwcError(f"{path}: unsupported architecture {raw.get('model_type')!r} "
                       "(qwc compiles Qwen2, Qwen2.5 and Qwen3's dense models)")
    # types and ranges first, then the sizes against the shards' tensors: transformers' own
    # config class would build a list as long as any num_hidden_layers it is handed
    first = ModelConfig.from_hf_dict(raw, name=path.name, source=str(cfg_path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QwcError(f"{path}: no *.safetensors weights")
    where, shapes, stored = {}, {}, {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    part = h.get_slice(k)
                    where[k], shapes[k], stored[k] = f, tuple(part.get_shape()), part.get_dtype()
        except (SafetensorError, OSError, ValueError) as e:
            raise QwcError(f"{f}: corrupt safetensors file ({str(e).splitlines()[0]})") from None
    # saved from the bare decoder (transformers' Qwen2Model / Qwen3Model, as the Qwen3-Embedding
    # models are): its tensors are the causal LM's without "model."
    bare = "embed_tokens.weight" in where and "model.embed_tokens.weight" not in where

    def hf_name(k: str) -> str:
        return f"model.{k}" if bare and k != "lm_head.weight" else k

    where = {hf_name(k): (f, k) for k, f in where.items()}   # HF name -> (file, the file's key)
    shapes = {hf_name(k): v for k, v in shapes.items()}
    stored = {hf_name(k): v for k, v in stored.items() if v in half_floats.KINDS}
    check_dimensions(first, shapes, str(cfg_path))
    try:
        hf = (Qwen3Config if raw["model_type"] == "qwen3" else Qwen2Config).from_dict(raw)
    except (TypeError, ValueError, StrictDataclassError) as e:
        # huggingface_hub's validation errors say what is wrong on their last line
        why = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise QwcError(f"{cfg_path}: transformers rejects it ({why[-1] if why else type(e).__name__})") from None
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        gen_eos = read_json_object(gen_path).get("eos_token_id")
        if gen_eos is not None:
            hf.eos_token_id = gen_eos
    cfg = ModelConfig.from_hf_dict(hf.to_dict(), name=path.name, source=str(path))
    tokenizer, cfg.chat_template = _load_tokenizer(path)

    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)   # some tied checkpoints store the copy anyway

    def read(name: str) -> np.ndarray:
        f, key = where[name]
        try:
            # Opened per tensor: the file is memory-mapped while open, and every page read
            # would stay in this process's RSS (15 GB for a 7B) until the map is closed.
            with safe_open(str(f), framework="pt") as h:
                t = h.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise QwcError(f"{f}: cannot read {name} ({str(e).splitlines()[0]})") from None
        return t.float().numpy()

    ckpt = Checkpoint(cfg, tokenizer, str(path), shapes, read, stored=stored)
    ckpt.check()
    return ckpt


def load_hf_dir(path: Path) -> LoadedModel:
    from .qwen2 import from_checkpoint

    return from_checkpoint(open_hf_dir(path), desc="reading safetensors")


def _load_tokenizer(path: Path) -> tuple[Tokenizer, str | None]:
    tok_file = path / "tokenizer.json"
    if tok_file.is_file():
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise QwcError(f"{tok_file}: unreadable tokenizer ({e})") from None
    else:
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(path).backend_tokenizer
        except Exception as e:
            raise QwcError(f"{path}: no usable tokenizer ({str(e).splitlines()[0]})") from None
    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "tokenizer_config.json").is_file():
        template = read_json_object(path / "tokenizer_config.json").get("chat_template")
    return tok, template


def foreign_hf_files(folder: Path, marker: str, command: str) -> str | None:
    """What in an existing `folder` is not a Hugging Face directory `command` wrote (None:
    nothing): its marker file and the files save_hf_dir writes, nothing else (qwc.atomic)."""
    if not folder.exists():
        return None
    if not (folder / marker).is_file():
        return f"it is not a folder {command} wrote (no {marker})"
    ours = {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", marker}
    extra = sorted(p.name for p in folder.iterdir()
                   if p.name not in ours and not (p.is_file() and p.name.startswith("model") and ".safetensors" in p.name))
    return f"it holds {extra[0]}, which {command} did not write" if extra else None


def save_hf_dir(lm: LoadedModel, out_dir: Path, marker: str, record: dict, command: str) -> None:
    """config.json, model.safetensors, tokenizer.json (+ chat template) and `marker` holding
    `record`, written atomically; an existing folder is replaced only if `command` wrote it."""
    def foreign(folder: Path) -> str | None:
        return foreign_hf_files(folder, marker, command)

    with staging_dir(out_dir, folder=True, foreign=foreign) as tmp:
        stage = tmp / out_dir.name
        lm.model.save_pretrained(stage, safe_serialization=True)
        lm.tokenizer.save(str(stage / "tokenizer.json"))
        if lm.config.chat_template:
            (stage / "chat_template.jinja").write_text(lm.config.chat_template)
        (stage / marker).write_text(json.dumps(record, indent=1))
        replace_dir(stage, out_dir, foreign)
