"""One entry point for every model source: a preset name, a HF directory, a .gguf file."""

from __future__ import annotations

from pathlib import Path

from qwc.errors import QwcError

from .presets import PRESET_NAMES, load_preset
from .qwen2 import LoadedModel


def load_source(source: str) -> LoadedModel:
    path = Path(source)
    if source in PRESET_NAMES:
        return load_preset(source)
    if path.is_dir():
        from .hf import load_hf_dir
        return load_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        from .gguf_loader import load_gguf
        if not path.is_file():
            raise QwcError(f"{source}: no such file")
        return load_gguf(path)
    if path.exists():
        raise QwcError(f"{source}: not a Hugging Face directory or a .gguf file")
    raise QwcError(f"{source!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor an existing path")
