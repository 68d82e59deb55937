"""Torch side of qwc: Qwen2 presets, checkpoint loading (HF, GGUF) and ONNX export."""
