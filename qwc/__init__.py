"""qwc: a compiler from quantization-aware-trained Qwen2 ONNX graphs to native int4 code."""

__version__ = "0.1.0"
