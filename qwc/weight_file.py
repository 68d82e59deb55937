"""Tensor payloads appended to one file as they are made, page-aligned, that ONNX initializers
refer to as external data: the streamed export's weights (models/stream_export.py) and the
weights the passes and the compiler's repacking make (passes/graph.py: weights_to).

Why: protobuf frees a message's bytes only with the whole message, so a weight put into the
graph stays in memory until the end (a 7B's 4.3 GB of Q4_0); written here as it is made, it
costs memory only while it is being made. Page-aligned, a tensor can be memory-mapped as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from qwc import half_floats
from qwc.errors import QwcError

PAGE = 4096
_CHUNK = 1 << 26   # bytes a write: a transposed view is written in row chunks, never copied whole


def external_location(t: onnx.TensorProto) -> str | None:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return next((e.value for e in t.external_data if e.key == "location"), None)


class WeightFile:
    """`location`: what the tensors record as their file (default: its absolute path; the
    streamed export records the name beside its graph)."""

    def __init__(self, path: Path, location: str | None = None):
        self.path = Path(path).resolve()
        self.location = location or str(self.path)
        self._f = open(self.path, "wb")
        self.size = 0
        self.written: set[int] = set()   # offsets, to tell whether dropped tensors left garbage
        self._sizes: dict[int, int] = {}   # offset -> bytes of each tensor not yet released

    def _start(self) -> int:
        pad = -self.size % PAGE
        self._f.write(b"\0" * pad)
        self.size += pad
        return self.size

    def _tensor(self, name: str, data_type: int, dims, offset: int, nbytes: int) -> onnx.TensorProto:
        self.size = offset + nbytes
        self.written.add(offset)
        self._sizes[offset] = nbytes
        self._f.flush()   # readable at once: a later pass may read what an earlier one wrote
        t = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims),
                             data_location=onnx.TensorProto.EXTERNAL)
        for k, v in (("location", self.location), ("offset", str(offset)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def add(self, array: np.ndarray, name: str, narrow: str | None = None) -> onnx.TensorProto:
        """`array` may be a view (a transposed weight): written a chunk of rows at a time.
        `narrow` ("BF16", "F16"): float32 values that are that type's, written in it
        (qwc/half_floats.py)."""
        a = np.asarray(array)
        offset = self._start()
        if a.ndim == 0:
            self._f.write(a.tobytes())
        else:
            rows = max(1, _CHUNK // max(1, a[0].nbytes))
            for r in range(0, len(a), rows):   # little-endian on every host qwc runs on
                self._f.write(half_floats.to_bits(a[r:r + rows], narrow).data if narrow
                              else np.ascontiguousarray(a[r:r + rows]).data)
        if narrow:
            return self._tensor(name, half_floats.KINDS[narrow][0], a.shape, offset, a.size * 2)
        return self._tensor(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape, offset, a.nbytes)

    def copy_in(self, t: onnx.TensorProto) -> onnx.TensorProto:
        """A copy of the external tensor `t` (in another file, by absolute path) in this one,
        by chunks of the file. A float32 one stored narrow is written widened, as float32."""
        info = {e.key: e.value for e in t.external_data}
        if kind := half_floats.stored_as(t):
            return self._copy_widened(t, info, kind)
        nbytes = int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        offset = self._start()
        with open(info["location"], "rb") as src:
            src.seek(int(info.get("offset", 0)))
            left = nbytes
            while left:
                chunk = src.read(min(left, _CHUNK))
                if not chunk:
                    raise QwcError(f"initializer {t.name}: its external data file {info['location']} is truncated")
                self._f.write(chunk)
                left -= len(chunk)
        return self._tensor(t.name, t.data_type, t.dims, offset, nbytes)

    def _copy_widened(self, t: onnx.TensorProto, info: dict, kind: str) -> onnx.TensorProto:
        count = int(np.prod(t.dims, dtype=np.int64))
        offset = self._start()
        with open(info["location"], "rb") as src:
            src.seek(int(info.get("offset", 0)))
            for start in range(0, count, _CHUNK // 4):
                part = half_floats.read_widened(src, min(count - start, _CHUNK // 4), kind)
                if part.size < min(count - start, _CHUNK // 4):
                    raise QwcError(f"initializer {t.name}: its external data file {info['location']} is truncated")
                self._f.write(part.data)
        return self._tensor(t.name, onnx.TensorProto.FLOAT, t.dims, offset, count * 4)

    def held(self) -> set[int]:
        """The offsets of the tensors written here and not released."""
        return set(self._sizes)

    def release(self, offsets) -> int:
        """Give the disk blocks of the tensors at `offsets` back to the file system: a hole
        punched where each was (the file's size is unchanged; reading there gives zeros). A
        compile's scratch file holds each weight as the passes made it, as each rewrite remade
        it and until params.bin has it, about three times the artifact at its end, where most of
        those bytes are never read again. Returns the bytes released; none
        where the file system cannot punch holes (the bytes then stay until the file goes)."""
        freed = 0
        for offset in offsets:
            if offset not in self._sizes:
                continue
            end = -(-(offset + self._sizes.pop(offset)) // PAGE) * PAGE   # the next tensor starts on a page
            if _punch_hole(self._f.fileno(), offset, end - offset):
                freed += end - offset
        return freed

    def close(self, sync: bool = False) -> None:
        """`sync`: on disk before the caller publishes the file."""
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())
        self._f.close()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate [offset, offset + length) of the open file `fd` (Linux's fallocate); False
    where the platform or file system does not do it (the bytes then stay on disk)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return False
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    return fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0
