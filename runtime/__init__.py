"""Loads a compiled artifact, owns the KV cache, prefills, decodes and samples."""
