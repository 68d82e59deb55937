"""ONNX -> TVM Relax -> a built artifact for a named target."""
