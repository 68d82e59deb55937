"""Readable names for linears ("model.layers.0.self_attn.q_proj", "lm_head"), from the
exporter's metadata (dynamo) or node names (legacy), for options and summaries."""

from __future__ import annotations

import ast

import onnx


def module_name(n: onnx.NodeProto) -> str:
    for p in n.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                break
            if len(scopes) >= 2:  # [..., module path, fx node name]
                return _strip(scopes[-2])
    if n.name.startswith("/"):
        parts = [s for s in n.name.split("/")[1:-1] if s]
        return _strip(".".join(parts))
    return n.name


def _strip(name: str) -> str:
    # The export wrapper nests the HF model one or two levels down ("w.model.model.layers...").
    parts = name.split(".")
    while parts and parts[0] in ("w", "model") and len(parts) > 1 and parts[1] in ("model", "lm_head", "w"):
        parts = parts[1:]
    return ".".join(parts)
