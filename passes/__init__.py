"""ONNX -> ONNX rewrites that raise an exported graph to the canonical int4 graph."""
