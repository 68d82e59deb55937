"""Loads a compiled artifact, owns the KV cache, prefills, decodes and samples."""

from .engine import Engine
from .sampling import SamplingParams

__all__ = ["Engine", "SamplingParams"]
