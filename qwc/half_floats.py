"""bf16 and fp16 weights on disk, float32 to the passes.

A checkpoint stored in bf16 or fp16 (safetensors, or a GGUF's BF16 / F16 tensors, what
convert_hf_to_gguf.py writes by default) holds matrices whose values are exactly those of the
narrow type, so the streamed export (models/stream_export.py) writes them as BFLOAT16 /
FLOAT16 initializers behind a Cast to float32: the graph runs in onnxruntime as it is, and
takes half the disk of a float32 graph (a 14B's float32 would not fit beside its checkpoint on
a 100 GB disk). The passes want float32 initializers named as the float graph names them, so
loading such a graph (passes/pipeline.py: load_graph) turns each such Cast into a float32
initializer that still points at the narrow bytes, marked with their type; every reader of
external data (passes/graph.py: tensor_array / tensor_view, qwc/weight_file.py: copy_in)
widens them as it reads. A marked tensor never reaches a saved file: the passes quantize it or
materialize it as float32 first.

The values are carried as their uint16 bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import numpy as np
import onnx

STORED_AS = "qwc_stored_as"   # an external_data key only qwc's own readers see
# a checkpoint's name for the type (safetensors' and GGUF's spelling) -> (ONNX type, the mark)
KINDS = {"BF16": (onnx.TensorProto.BFLOAT16, "bfloat16"), "F16": (onnx.TensorProto.FLOAT16, "float16")}
_MARKS = {mark: kind for kind, (_, mark) in KINDS.items()}
_KIND_OF_TYPE = {t: kind for kind, (t, _) in KINDS.items()}
_ROWS = 1 << 22   # elements widened at a time: no uint32 temporary of a whole 3 GB head


def kind_of_type(data_type: int) -> str | None:
    """"BF16" / "F16" for an ONNX BFLOAT16 / FLOAT16 type, else None."""
    return _KIND_OF_TYPE.get(data_type)


def to_bits(a: np.ndarray, kind: str) -> np.ndarray:
    """float32 values that are `kind`'s values (a narrow checkpoint's, widened) as that type's
    bits: bf16 the high half of each float32, fp16 its IEEE half; exact either way."""
    a = np.ascontiguousarray(a, np.float32)
    if kind == "BF16":
        return (a.view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(np.float16).view(np.uint16)


def widen(bits: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """`kind`'s bits as float32 (exact), in chunks into `out` (flat float32 of the same size)."""
    flat = bits.reshape(-1)
    out = np.empty(flat.size, np.float32) if out is None else out
    for i in range(0, flat.size, _ROWS):
        part = flat[i:i + _ROWS]
        if kind == "BF16":
            out.view(np.uint32)[i:i + _ROWS] = part.astype(np.uint32) << 16
        else:
            out[i:i + _ROWS] = part.view(np.float16)
    return out.reshape(bits.shape)


def read_widened(f, count: int, kind: str) -> np.ndarray:
    """`count` values of `kind` from open file `f` as float32, read a chunk at a time into the
    result (peak: the float32 array, not it and the bits); shorter if the file ends first."""
    out = np.empty(count, np.float32)
    done = 0
    while done < count:
        bits = np.fromfile(f, np.uint16, min(count - done, _ROWS))
        if not bits.size:
            return out[:done]
        widen(bits, kind, out[done:done + bits.size])
        done += bits.size
    return out


def stored_as(t: onnx.TensorProto) -> str | None:
    """The narrow type ("BF16", "F16") external float32 tensor `t` holds on disk (marked at
    load), or None."""
    return next((_MARKS.get(e.value) for e in t.external_data if e.key == STORED_AS), None)


def mark(t: onnx.TensorProto) -> None:
    """Make narrow initializer `t` (external) a float32 one whose bytes stay narrow on disk."""
    mark_value = KINDS[kind_of_type(t.data_type)][1]
    t.data_type = onnx.TensorProto.FLOAT
    e = t.external_data.add()
    e.key, e.value = STORED_AS, mark_value


def inline_bits(t: onnx.TensorProto) -> np.ndarray:
    """An in-message narrow initializer's bits (raw_data, or int32_data as onnx's helpers store it)."""
    if t.raw_data:
        return np.frombuffer(t.raw_data, np.uint16).reshape(tuple(t.dims))
    return np.array(t.int32_data, np.uint32).astype(np.uint16).reshape(tuple(t.dims))


class WidenedView:
    """A read-only memory map of narrow bits that gives float32 slices: what tensor_view returns
    for a float32 tensor stored narrow (only slices are read, as a memory map reads them)."""

    def __init__(self, bits: np.ndarray, kind: str):
        self._bits, self._kind = bits, kind
        self.shape, self.ndim, self.dtype = bits.shape, bits.ndim, np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        return widen(np.ascontiguousarray(self._bits[index]), self._kind)
