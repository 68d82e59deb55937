"""bfloat16 weights on disk, float32 to the passes.

A bf16 checkpoint's matrices are exactly representable in bf16, so the streamed export
(models/stream_export.py) writes them as bf16 initializers behind a Cast to float32: the graph
runs in onnxruntime as it is, and takes half the disk of a float32 graph (a 14B's 59 GB of
float32 would not fit beside its checkpoint on a 100 GB disk). The passes want float32
initializers named as the float graph names them, so loading such a graph
(passes/pipeline.py: load_graph) turns each Cast of a bf16 initializer into a float32
initializer that still points at the bf16 bytes, marked so; every reader of external data
(passes/graph.py: tensor_array / tensor_view, qwc/weight_file.py: copy_in) widens the bits
as it reads them. A marked tensor never reaches a saved file: the passes quantize it or
materialize it as float32 first.

numpy has no bfloat16: the values are carried as their uint16 bit patterns (the high half
of the float32's bits).
"""

from __future__ import annotations

import numpy as np
import onnx

STORED_AS = "qwc_stored_as"   # an external_data key only qwc's own readers see
BFLOAT16 = "bfloat16"
_ROWS = 1 << 22   # elements widened at a time: no uint32 temporary of a whole 3 GB head


def to_bits(a: np.ndarray) -> np.ndarray:
    """float32 values that are bf16 values (a bf16 checkpoint's, widened) as bf16 bits: the
    high half of each float32, which drops nothing."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widen(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 bits as float32 (exact), in chunks into `out` (flat float32 of the same size)."""
    flat = bits.reshape(-1)
    out = np.empty(flat.size, np.float32) if out is None else out
    words = out.view(np.uint32)
    for i in range(0, flat.size, _ROWS):
        words[i:i + _ROWS] = flat[i:i + _ROWS].astype(np.uint32) << 16
    return out.reshape(bits.shape)


def read_widened(f, count: int) -> np.ndarray:
    """`count` bf16 values from open file `f` as float32, read a chunk at a time into the
    result (peak: the float32 array, not it and the bits); shorter if the file ends first."""
    out = np.empty(count, np.float32)
    done = 0
    while done < count:
        bits = np.fromfile(f, np.uint16, min(count - done, _ROWS))
        if not bits.size:
            return out[:done]
        widen(bits, out[done:done + bits.size])
        done += bits.size
    return out


def stored_as_bf16(t: onnx.TensorProto) -> bool:
    """Whether external float32 tensor `t` holds bf16 bytes on disk (marked at load)."""
    return any(e.key == STORED_AS and e.value == BFLOAT16 for e in t.external_data)


def mark(t: onnx.TensorProto) -> None:
    """Make bf16 initializer `t` (external) a float32 one whose bytes are bf16 on disk."""
    t.data_type = onnx.TensorProto.FLOAT
    e = t.external_data.add()
    e.key, e.value = STORED_AS, BFLOAT16


def inline_bits(t: onnx.TensorProto) -> np.ndarray:
    """An in-message bf16 initializer's bits (raw_data, or int32_data as onnx's helpers store it)."""
    if t.raw_data:
        return np.frombuffer(t.raw_data, np.uint16).reshape(tuple(t.dims))
    return np.array(t.int32_data, np.uint32).astype(np.uint16).reshape(tuple(t.dims))


class WidenedView:
    """A read-only memory map of bf16 bits that gives float32 slices: what tensor_view returns
    for a float32 tensor stored as bf16 (only slices are read, as a memory map reads them)."""

    def __init__(self, bits: np.ndarray):
        self._bits = bits
        self.shape, self.ndim, self.dtype = bits.shape, bits.ndim, np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        return widen(np.ascontiguousarray(self._bits[index]))
