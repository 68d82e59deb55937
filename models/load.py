"""One entry point for every model source: a preset name, a HF directory, a .gguf file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qwc.errors import QwcError

from .checkpoint import Checkpoint
from .presets import PRESET_NAMES, is_checkpoint_preset, load_preset, preset_checkpoint

if TYPE_CHECKING:
    from .qwen2 import LoadedModel

# `qwc export --exporter auto` streams checkpoints from this size: the torch exporter holds
# about 8 bytes a parameter (the float32 model and its folded transposes), 8 GB at 1B.
STREAM_FROM_PARAMS = 1_000_000_000


def load_source(source: str) -> LoadedModel:
    from .qwen2 import from_checkpoint  # torch: only where a model is built in it

    if source in PRESET_NAMES:
        return load_preset(source)
    return from_checkpoint(open_checkpoint(source))


def open_checkpoint(source: str) -> Checkpoint:
    """A HF directory, a .gguf file or a preset made as a checkpoint, opened without reading
    its weights."""
    path = Path(source)
    if is_checkpoint_preset(source):
        return preset_checkpoint(source)
    if source in PRESET_NAMES:
        raise QwcError(f"{source} is a preset built in code, not a checkpoint file")
    if path.is_dir():
        from .hf import open_hf_dir
        return open_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        from .gguf_loader import open_gguf
        if not path.is_file():
            raise QwcError(f"{source}: no such file")
        return open_gguf(path)
    if path.exists():
        raise QwcError(f"{source}: not a Hugging Face directory or a .gguf file")
    raise QwcError(f"{source!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor an existing path")
